//! Statistics of an evaluation: mean, standard error, a 95% confidence interval of
//! the mean reward that never leaves the range the rewards lie in, and the unbiased
//! pass@k estimator.

use sha2::{Digest, Sha256};

/// Mean, sample standard deviation and standard error of `xs`.
pub fn mean_sd_se(xs: &[f64]) -> (f64, f64, f64) {
    let n = xs.len();
    if n == 0 {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, 0.0, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let sd = var.sqrt();
    (mean, sd, sd / (n as f64).sqrt())
}

/// The two-sided 95% critical value of Student's t with `df` degrees of freedom
/// (exact to three decimals for df ≤ 30, a series expansion above).
pub fn t_critical_95(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    if df == 0 {
        return f64::NAN;
    }
    if df <= TABLE.len() {
        return TABLE[df - 1];
    }
    // Cornish–Fisher expansion of t around the normal quantile.
    let z: f64 = 1.959_963_985;
    let v = df as f64;
    z + (z.powi(3) + z) / (4.0 * v)
        + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * v * v)
        + (3.0 * z.powi(7) + 19.0 * z.powi(5) + 17.0 * z.powi(3) - 15.0 * z) / (384.0 * v.powi(3))
}

/// The two-sided 95% normal quantile, z(0.975).
const Z_95: f64 = 1.959_963_985;

/// Resamples drawn for a bootstrap interval: enough that the 2.5% and 97.5%
/// percentiles move by well under the printed precision from one seed to another.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;

/// The bootstrap's fixed seed: the same rewards always give the same interval, so a
/// summary is reproducible and a resumed run reports what a fresh one would.
const BOOTSTRAP_SEED: u64 = 0x5eed_c195;

/// The 95% confidence interval of the mean of `xs`, as (low, high).
///
/// Rewards are usually bounded (a success in {0, 1}, a score in [0, 1]), and a normal
/// or Student-t interval of a bounded mean leaves the range near its ends (three
/// successes in ten gave [−0.10, 0.50]). So:
///
/// - binary rewards (every value 0 or 1): the Wilson score interval, which lies in
///   [0, 1] and is not degenerate at 0/n or n/n (0 of 10 gives [0, 0.278]);
/// - any other rewards: the bootstrap percentile interval ([`BOOTSTRAP_RESAMPLES`]
///   resamples, fixed seed). Every resampled mean lies between the smallest and the
///   largest reward seen, so the interval never leaves a range the rewards obey,
///   whether or not that range is known here (an episode's total reward has no
///   declared range), and it needs no bound for unbounded rewards.
///
/// The interval always contains the mean. Fewer than one value gives NaNs; a single
/// non-binary value gives (value, value).
pub fn ci95(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let (low, high) = if xs.iter().all(|&x| x == 0.0 || x == 1.0) {
        let successes = xs.iter().filter(|&&x| x == 1.0).count();
        wilson95(successes, xs.len())
    } else {
        bootstrap95(xs)
    };
    (low.min(mean), high.max(mean))
}

/// The 95% Wilson score interval of a proportion: `successes` of `n` trials.
pub fn wilson95(successes: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let n = n as f64;
    let p = successes as f64 / n;
    let z2 = Z_95 * Z_95;
    let denominator = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denominator;
    let half = Z_95 * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / denominator;
    // Rounding can put an end a hair outside [0, 1] at p = 0 or 1.
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// The 95% bootstrap percentile interval of the mean of `xs` (deterministic seed).
fn bootstrap95(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    let mut rng = SplitMix64(BOOTSTRAP_SEED);
    let mut means: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| (0..n).map(|_| xs[rng.below(n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    (percentile(&means, 0.025), percentile(&means, 0.975))
}

/// The `q` quantile of sorted `xs`, interpolating linearly between neighbours.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let position = q * (sorted.len() - 1) as f64;
    let below = position.floor() as usize;
    let above = position.ceil() as usize;
    let weight = position - below as f64;
    sorted[below] + (sorted[above] - sorted[below]) * weight
}

/// SplitMix64: a tiny generator whose output is fixed by its definition, so a
/// bootstrap interval does not change when a dependency's generator does.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (multiply-shift; the bias is below 2⁻³² for any `n` here).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }
}

/// The unbiased estimate of pass@k for a task with `n` samples of which `c` passed
/// (Chen et al., 2021): 1 − C(n−c, k) / C(n, k).
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k == 0 || k > n {
        return f64::NAN;
    }
    if n - c < k {
        return 1.0;
    }
    // Product form, numerically stable: ∏_{i=n−c+1}^{n} (1 − k/i).
    1.0 - ((n - c + 1)..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// The first 12 hex digits of the SHA-256 of `text`.
pub fn short_hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_interval() {
        let (m, sd, se) = mean_sd_se(&[1.0, 0.0, 1.0, 0.0]);
        assert_eq!(m, 0.5);
        assert!((sd - (1.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((se - sd / 2.0).abs() < 1e-12);
        assert_eq!(ci95(&[0.3]), (0.3, 0.3));
        assert!(ci95(&[]).0.is_nan());
    }

    /// Published interval ends are given to three decimals.
    const PUBLISHED_TOLERANCE: f64 = 5e-4;

    fn assert_interval(got: (f64, f64), want: (f64, f64)) {
        assert!(
            (got.0 - want.0).abs() < PUBLISHED_TOLERANCE
                && (got.1 - want.1).abs() < PUBLISHED_TOLERANCE,
            "got {got:?}, want {want:?}"
        );
    }

    /// Regression (issue 20): three successes in ten had the normal interval
    /// [−0.102, 0.502], below the lowest reward there is.
    #[test]
    fn binary_rewards_get_the_wilson_interval() {
        let three_of_ten = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_interval(ci95(&three_of_ten), (0.108, 0.603));
        assert_interval(ci95(&[0.0; 10]), (0.0, 0.278));
        assert_interval(ci95(&[1.0; 10]), (0.722, 1.0));
        assert_interval(wilson95(3, 10), (0.108, 0.603));
        assert!(wilson95(0, 0).0.is_nan());
    }

    #[test]
    fn bounded_rewards_stay_in_their_range() {
        // Scores in [0, 1], most at 0: a t-interval went below 0 here.
        let scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.9];
        let (low, high) = ci95(&scores);
        let mean = scores.iter().sum::<f64>() / scores.len() as f64;
        assert!(
            0.0 <= low && low <= mean && mean <= high && high <= 0.9,
            "{low} {high}"
        );
        // Deterministic: the same rewards, the same interval.
        assert_eq!(ci95(&scores), (low, high));
        // Constant rewards have no spread to resample.
        assert_eq!(ci95(&[0.5; 4]), (0.5, 0.5));
    }

    /// Unbounded rewards: the bootstrap agrees with Student's t on a sample large
    /// enough for both to hold.
    #[test]
    fn unbounded_rewards_match_the_t_interval_on_large_samples() {
        const AGREEMENT: f64 = 0.1;
        let xs: Vec<f64> = (0..200).map(|i| f64::from((i * 37) % 101) - 50.0).collect();
        let (mean, _, se) = mean_sd_se(&xs);
        let t = t_critical_95(xs.len() - 1) * se;
        let (low, high) = ci95(&xs);
        assert!(
            ((mean - low) / t - 1.0).abs() < AGREEMENT,
            "{low} {mean} {t}"
        );
        assert!(
            ((high - mean) / t - 1.0).abs() < AGREEMENT,
            "{high} {mean} {t}"
        );
    }

    #[test]
    fn t_values_match_tables() {
        assert_eq!(t_critical_95(19), 2.093);
        // Published: t(0.975, 40) = 2.021, t(0.975, 100) = 1.984, t(0.975, 1000) = 1.962.
        assert!((t_critical_95(40) - 2.021).abs() < 2e-3);
        assert!((t_critical_95(100) - 1.984).abs() < 1e-3);
        assert!((t_critical_95(1000) - 1.962).abs() < 1e-3);
    }

    #[test]
    fn pass_at_k_is_the_unbiased_estimator() {
        assert_eq!(pass_at_k(5, 0, 1), 0.0);
        assert_eq!(pass_at_k(5, 5, 3), 1.0);
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
        // 1 − C(2,2)/C(4,2) = 1 − 1/6.
        assert!((pass_at_k(4, 2, 2) - (1.0 - 1.0 / 6.0)).abs() < 1e-12);
        assert!(pass_at_k(2, 1, 3).is_nan());
    }
}
