//! `agentstack model imatrix`: an importance matrix from calibration text.

use std::path::Path;

use agentstack_model::{LanguageModel, WeightForm};
use agentstack_quant::imatrix::Imatrix;
use anyhow::Context;

use crate::args::ImatrixArgs;
use crate::{Exit, IntoUserError};

/// Collects the importance matrix of the model at `path` over `text`, with a progress bar.
pub(crate) fn collect(
    path: &Path,
    text: &str,
    ctx: usize,
    dataset: &str,
    process_output: bool,
) -> anyhow::Result<Imatrix> {
    let lm =
        LanguageModel::load(path, WeightForm::Quantized).context("could not load the model")?;
    let tokens = lm.tokenizer().encode(text, false)?;
    let bar = super::steps_bar(tokens.len() / ctx.max(1), "collecting importance");
    let m = Imatrix::collect(
        lm.model(),
        &tokens,
        ctx,
        dataset,
        process_output,
        &mut |done, _| bar.set_position(done as u64),
    )?;
    bar.finish_and_clear();
    Ok(m)
}

/// Runs the command.
pub async fn run(args: ImatrixArgs) -> Result<(), Exit> {
    let path = super::resolve(&args.model).await?;
    let text = std::fs::read_to_string(&args.text)
        .with_user_context(|| format!("could not read --text {}", args.text.display()))?;
    let dataset = args.text.display().to_string();
    let (ctx, process_output) = (args.ctx, args.process_output);
    let m =
        tokio::task::spawn_blocking(move || collect(&path, &text, ctx, &dataset, process_output))
            .await
            .map_err(anyhow::Error::from)??;
    if args.output.extension().is_some_and(|e| e == "dat") {
        m.save_dat(&args.output)
    } else {
        m.save_gguf(&args.output)
    }
    .context("could not write the importance matrix")?;
    println!(
        "wrote {} ({} weights, {} chunks of {} tokens)",
        args.output.display(),
        m.entries.len(),
        m.chunk_count,
        m.chunk_size
    );
    Ok(())
}
