//! `metrics.jsonl`, read back: the curves and the evaluations of a resumed run.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::checkpoint::truncate_lines;
use super::error::io;
use super::{StepMetrics, TrainError};

/// A run's `metrics.jsonl`, one line per step done.
pub(super) struct MetricsLog {
    path: PathBuf,
    /// Lines written (what a checkpoint records, so a resume drops the later ones).
    lines: usize,
}

impl MetricsLog {
    /// Opens `path`, keeping its first `keep` lines (those of the steps a checkpoint
    /// holds; a torn last line goes too).
    pub(super) fn open(path: PathBuf, keep: usize) -> Result<Self, TrainError> {
        truncate_lines(&path, keep)?;
        let lines = fs::read_to_string(&path)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        Ok(Self { path, lines })
    }

    /// Lines written.
    pub(super) fn lines(&self) -> usize {
        self.lines
    }

    /// The held-out rewards written so far, by step (0: before training).
    pub(super) fn evals(&self) -> BTreeMap<usize, (f64, (f64, f64))> {
        read_evals(&self.path)
    }

    /// Appends a step's line, synced to disk.
    pub(super) fn append(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        let line = serde_json::to_string(m).unwrap_or_default();
        let mut file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(io(&self.path))?;
        writeln!(file, "{line}").map_err(io(&self.path))?;
        file.sync_data().map_err(io(&self.path))?;
        self.lines += 1;
        Ok(())
    }

    /// Draws the reward curve (with the held-out `evals`) to `reward.png` beside the
    /// log and, with distillation, the reverse KL to `reverse_kl.png`. A plot that
    /// cannot be drawn is logged, never fatal.
    pub(super) fn draw_curves(&self, evals: &BTreeMap<usize, (f64, (f64, f64))>, run_id: &str) {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let lines = read_metrics(&self.path);
        let curve: Vec<(usize, f64)> = lines
            .iter()
            .filter(|m| m.reward_mean.is_finite())
            .map(|m| (m.step, m.reward_mean))
            .collect();
        if let Err(e) = crate::plot::reward_curve(&curve, evals, &dir.join("reward.png"), run_id) {
            tracing::warn!(error = %e, "could not draw the reward curve");
        }
        let kl: Vec<(usize, f64)> = lines
            .iter()
            .filter_map(|m| Some((m.step, m.reverse_kl?)))
            .collect();
        if !kl.is_empty()
            && let Err(e) = crate::plot::step_curve(
                &kl,
                &dir.join("reverse_kl.png"),
                &format!("Reverse KL to the teacher: {run_id}"),
                "mean log p_student − log p_teacher",
            )
        {
            tracing::warn!(error = %e, "could not draw the reverse KL curve");
        }
    }
}

fn read_metrics(path: &Path) -> Vec<StepMetrics> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn read_evals(path: &Path) -> BTreeMap<usize, (f64, (f64, f64))> {
    let mut evals = BTreeMap::new();
    if let Some(before) = path
        .parent()
        .and_then(|d| fs::read(d.join("eval-0.json")).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
    {
        evals.insert(0, before);
    }
    for m in read_metrics(path) {
        if let (Some(r), Some(ci)) = (m.eval_reward, m.eval_ci95) {
            evals.insert(m.step, (r, ci));
        }
    }
    evals
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: usize, eval: Option<f64>) -> String {
        let m = StepMetrics {
            step,
            eval_reward: eval,
            eval_ci95: eval.map(|e| (e - 0.1, e + 0.1)),
            ..StepMetrics::default()
        };
        serde_json::to_string(&m).unwrap() + "\n"
    }

    /// A resumed run keeps the lines of the steps its checkpoint holds (a later or
    /// torn line goes), counts on from there, and finds the evaluations written.
    #[test]
    fn a_resumed_log_keeps_the_checkpointed_lines_and_counts_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let torn = "{\"step\": 4, \"rew";
        let text = [
            line(1, None),
            line(2, Some(0.5)),
            line(3, Some(0.7)),
            torn.into(),
        ]
        .concat();
        fs::write(&path, text).unwrap();
        fs::write(dir.path().join("eval-0.json"), "[0.25,[0.2,0.3]]").unwrap();

        let mut log = MetricsLog::open(path.clone(), 2).unwrap();
        assert_eq!(log.lines(), 2);
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            [line(1, None), line(2, Some(0.5))].concat()
        );
        let evals = log.evals();
        assert_eq!(evals.keys().copied().collect::<Vec<_>>(), [0, 2]);
        assert_eq!(evals[&0], (0.25, (0.2, 0.3)));

        log.append(&StepMetrics {
            step: 3,
            ..StepMetrics::default()
        })
        .unwrap();
        assert_eq!(log.lines(), 3);
        assert_eq!(
            read_metrics(&path)
                .iter()
                .map(|m| m.step)
                .collect::<Vec<_>>(),
            [1, 2, 3]
        );

        // A fresh start keeps nothing.
        assert_eq!(MetricsLog::open(path.clone(), 0).unwrap().lines(), 0);
        assert_eq!(fs::read_to_string(&path).unwrap(), "");
    }
}
