//! `agentstack model quantize`: a GGUF model to another type.

use agentstack_quant::gguf::Gguf;
use agentstack_quant::imatrix::Imatrix;
use agentstack_quant::recipe::{Plan, quantize_file};
use agentstack_quant::types::GgmlType;
use anyhow::{Context, anyhow};

use crate::Exit;
use crate::args::QuantizeArgs;

/// Runs the command.
pub async fn run(args: QuantizeArgs) -> Result<(), Exit> {
    let ty: GgmlType = args
        .ty
        .parse()
        .map_err(|e: String| anyhow!("--type: {e}"))?;
    let input = super::resolve(&args.input).await?;
    let imatrix = match (&args.imatrix, &args.calibration) {
        (Some(path), _) => Some(Imatrix::load(path).context("could not read --imatrix")?),
        (None, Some(text)) => {
            let text = std::fs::read_to_string(text)
                .with_context(|| format!("could not read --calibration {}", text.display()))?;
            let (input, ctx) = (input.clone(), args.ctx);
            Some(
                tokio::task::spawn_blocking(move || {
                    super::imatrix::collect(&input, &text, ctx, "calibration")
                })
                .await
                .map_err(anyhow::Error::from)??,
            )
        }
        (None, None) => None,
    };
    let output = args.output.clone();
    let report = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let mut file = Gguf::open(&input).context("could not open the model")?;
        let plan = Plan::uniform(&file, ty);
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
