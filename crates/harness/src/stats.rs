//! Statistics of an evaluation: mean, standard error, Student-t confidence interval,
//! and the unbiased pass@k estimator.

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

/// The 95% confidence interval of the mean of `xs` (Student t), as (low, high).
pub fn ci95(xs: &[f64]) -> (f64, f64) {
    let (mean, _, se) = mean_sd_se(xs);
    if xs.len() < 2 {
        return (mean, mean);
    }
    let h = t_critical_95(xs.len() - 1) * se;
    (mean - h, mean + h)
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
        let (lo, hi) = ci95(&[1.0, 0.0, 1.0, 0.0]);
        assert!((hi - lo - 2.0 * 3.182 * se).abs() < 1e-9);
        assert_eq!(ci95(&[0.3]), (0.3, 0.3));
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
