//! `agentstack model ...`

pub mod generate;
pub mod imatrix;
pub mod info;
pub mod kld;
pub mod pull;
pub mod quantize;
pub mod serve;

use std::path::PathBuf;
use std::time::Duration;

use agentstack_model::pull::{ModelRef, pull};
use agentstack_model::{LanguageModel, WeightForm};
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use crate::settings;

/// Resolves a model reference to a local file, downloading it (with a progress bar) if
/// needed.
pub(crate) async fn resolve(reference: &str) -> anyhow::Result<PathBuf> {
    let model = ModelRef::parse(reference)?;
    let models = settings::models_dir();
    let dest = model.cache_path(&models);
    if dest.is_file() || (matches!(model, ModelRef::Local(_)) && dest.exists()) {
        return Ok(dest);
    }
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(format!("pulling {reference}"));
    bar.enable_steady_tick(Duration::from_millis(200));
    let progress = |done: u64, total: Option<u64>| {
        if let Some(total) = total {
            bar.set_length(total);
        }
        bar.set_position(done);
    };
    let result = pull(&model, &models, &progress).await;
    bar.finish_and_clear();
    result.with_context(|| format!("could not fetch {reference}"))
}

/// A bar for `total` steps of a long model operation, on stderr.
pub(crate) fn steps_bar(total: usize, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(message.to_owned());
    bar
}

/// Resolves and loads a model for inference. (`--threads` was applied by `main`,
/// before any thread started: see `set_compute_threads`.)
pub(crate) async fn load(reference: &str, threads: Option<usize>) -> anyhow::Result<LanguageModel> {
    if threads == Some(0) {
        return Err(crate::user_error!("--threads must be at least 1"));
    }
    let path = resolve(reference).await?;
    tokio::task::spawn_blocking(move || LanguageModel::load(&path, WeightForm::Quantized))
        .await?
        .context("could not load the model")
}
