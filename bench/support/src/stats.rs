//! Latency figures over a run's samples, and the progress bar a run shows meanwhile.

use indicatif::{ProgressBar, ProgressStyle};

/// Latency figures, in the samples' unit (the benchmarks use milliseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// How many samples.
    pub n: usize,
    /// The median (nearest rank).
    pub p50: f64,
    /// The 99th percentile (nearest rank).
    pub p99: f64,
    /// The mean; NaN without samples.
    pub mean: f64,
    /// The smallest sample; NaN without samples.
    pub min: f64,
    /// The largest sample; NaN without samples.
    pub max: f64,
}

impl Stats {
    /// The figures of `samples`, in any order.
    pub fn of(samples: &[f64]) -> Self {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Self {
            n: sorted.len(),
            p50: percentile(&sorted, 50.0),
            p99: percentile(&sorted, 99.0),
            mean: mean(&sorted),
            min: sorted.first().copied().unwrap_or(f64::NAN),
            max: sorted.last().copied().unwrap_or(f64::NAN),
        }
    }
}

/// The nearest-rank percentile of sorted samples: the smallest sample with at least
/// `p`% of the samples at or below it; NaN without samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The mean; NaN without samples.
pub fn mean(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        f64::NAN
    } else {
        samples.iter().sum::<f64>() / samples.len() as f64
    }
}

/// A progress bar of `total` steps drawn with `template` (indicatif's), showing `message`.
pub fn progress(total: usize, template: &str, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(message.to_owned());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 50.0), 50.0);
        assert_eq!(percentile(&samples, 99.0), 99.0);
        assert_eq!(percentile(&samples, 100.0), 100.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn stats_of_unsorted_samples() {
        let stats = Stats::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(
            (stats.n, stats.min, stats.max, stats.mean, stats.p50),
            (4, 1.0, 4.0, 2.5, 2.0)
        );
        assert!(Stats::of(&[]).mean.is_nan());
    }
}
