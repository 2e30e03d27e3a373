//! Checkpoints: the adapters, the optimizer's moments, the adapters that sampled the
//! next step's batch, and the step, written to `step-N.partial` and renamed, so a
//! checkpoint is whole or absent.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use agentstack_model::Model;

use super::TrainError;
use super::error::{io, tensor, tensors};
use crate::lora::Lora;
use crate::optim::Optim;

/// Where a run starts: a fresh start, or a checkpoint read back.
pub(super) struct Start {
    /// Steps done (0: a fresh start).
    pub(super) step: usize,
    /// Lines of `metrics.jsonl` that belong to those steps.
    pub(super) metrics_lines: usize,
    pub(super) lora: Lora,
    pub(super) optim: Optim,
    /// The adapters that sampled the next step's batch (runs one step ahead).
    pub(super) next_sampler: Option<Lora>,
    /// Where an asynchronous run's rollouts go on in its task sequence.
    pub(super) next_position: Option<u64>,
}

/// Where a run in `dir` starts: from the fresh `lora` and `optim`, or from the newest
/// checkpoint there, read onto `base` with a new optimizer configured as `optim`.
pub(super) fn start(
    dir: &Path,
    base: &Model,
    lora: Lora,
    optim: Optim,
) -> Result<Start, TrainError> {
    let Some((step, path)) = latest_checkpoint(dir) else {
        return Ok(Start {
            step: 0,
            metrics_lines: 0,
            lora,
            optim,
            next_sampler: None,
            next_position: None,
        });
    };
    let adapter = path.join("adapter.safetensors");
    let lora = Lora::load(&adapter, base).map_err(tensors("read", &adapter))?;
    let mut optim = Optim::new(lora.vars(), optim.config().clone())
        .map_err(tensor("creating the optimizer"))?;
    let moments = path.join("optim.safetensors");
    optim.load(&moments).map_err(tensors("read", &moments))?;
    let prev = path.join("adapter_prev.safetensors");
    let next_sampler = if prev.is_file() {
        Some(Lora::load(&prev, base).map_err(tensors("read", &prev))?)
    } else {
        None
    };
    let state_path = path.join("state.json");
    let state: CheckpointState = serde_json::from_slice(
        &fs::read(&state_path).map_err(io(&state_path))?,
    )
    .map_err(|source| TrainError::Json {
        path: state_path.clone(),
        line: None,
        source,
    })?;
    tracing::info!(step, "resuming from checkpoint");
    Ok(Start {
        step,
        metrics_lines: state.metrics_lines,
        lora,
        optim,
        next_sampler,
        next_position: state.next_position,
    })
}

/// What a checkpoint holds besides the adapters and the optimizer.
pub(super) struct Extra<'a> {
    /// Lines of `metrics.jsonl` that belong to the steps done.
    pub(super) metrics_lines: usize,
    /// The adapters that sampled the next step's batch (one step ahead).
    pub(super) next_sampler: Option<&'a Lora>,
    /// Where an asynchronous run's rollouts go on.
    pub(super) next_position: Option<u64>,
}

/// Writes the checkpoint of `step`: the adapters, the optimizer's moments, the
/// adapters that sampled the next step's batch (one step ahead), and the state.
pub(super) fn write(
    dir: &Path,
    step: usize,
    lora: &Lora,
    optim: &Optim,
    extra: Extra<'_>,
) -> Result<(), TrainError> {
    let Extra {
        metrics_lines,
        next_sampler,
        next_position,
    } = extra;
    let target = checkpoint_dir(dir, step);
    let partial = target.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial).map_err(io(&partial))?;
    let adapter = partial.join("adapter.safetensors");
    lora.save(&adapter).map_err(tensors("write", &adapter))?;
    let moments = partial.join("optim.safetensors");
    optim.save(&moments).map_err(tensors("write", &moments))?;
    if let Some(sampler) = next_sampler {
        let prev = partial.join("adapter_prev.safetensors");
        sampler.save(&prev).map_err(tensors("write", &prev))?;
    }
    write_atomic(
        &partial.join("state.json"),
        &serde_json::to_vec(&CheckpointState {
            step,
            metrics_lines,
            next_position,
        })
        .unwrap_or_default(),
    )?;
    let _ = fs::remove_dir_all(&target);
    fs::rename(&partial, &target).map_err(io(&target))
}

/// A checkpoint's `state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CheckpointState {
    /// Steps done.
    step: usize,
    /// Lines of `metrics.jsonl` that belong to those steps.
    metrics_lines: usize,
    /// Where an asynchronous run's rollouts go on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_position: Option<u64>,
}

fn checkpoint_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join("checkpoints").join(format!("step-{step:06}"))
}

/// The newest complete checkpoint (written to `.partial` and renamed).
fn latest_checkpoint(dir: &Path) -> Option<(usize, PathBuf)> {
    let entries = fs::read_dir(dir.join("checkpoints")).ok()?;
    entries
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse::<usize>().ok()?;
            e.path()
                .join("state.json")
                .is_file()
                .then(|| (step, e.path()))
        })
        .max_by_key(|(s, _)| *s)
}

pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let tmp = path.with_extension("partial");
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    fs::rename(&tmp, path).map_err(io(path))
}

/// Keeps the first `lines` lines of a JSON-lines file (and drops a torn last line).
pub(super) fn truncate_lines(path: &Path, lines: usize) -> Result<(), TrainError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(path)(e)),
    };
    let kept: String = text
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .take(lines)
        .collect();
    write_atomic(path, kept.as_bytes())
}

/// Keeps the newest `keep` checkpoints.
pub(super) fn prune(dir: &Path, keep: usize) -> Result<(), TrainError> {
    let root = dir.join("checkpoints");
    let mut steps: Vec<(usize, PathBuf)> = fs::read_dir(&root)
        .map_err(io(&root))?
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            Some((name.strip_prefix("step-")?.parse().ok()?, e.path()))
        })
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for (_, path) in steps.into_iter().take(excess) {
        fs::remove_dir_all(&path).map_err(io(&path))?;
    }
    Ok(())
}
