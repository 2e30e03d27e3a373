//! Advantages and reward shaping for group-sampled rollouts (GRPO: several samples per
//! prompt, each judged against its group).

/// How a group's rewards become advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Normalization {
    /// `(R − mean) / std` (GRPO).
    #[default]
    Std,
    /// `R − mean` (Dr. GRPO: no division by the standard deviation).
    MeanOnly,
}

/// Added to a standard deviation before dividing by it.
pub const STD_EPSILON: f64 = 1e-6;

/// The advantage of each sample in one group.
pub fn group_advantages(rewards: &[f64], normalization: Normalization) -> Vec<f64> {
    if rewards.is_empty() {
        return Vec::new();
    }
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let centred: Vec<f64> = rewards.iter().map(|r| r - mean).collect();
    match normalization {
        Normalization::MeanOnly => centred,
        Normalization::Std => {
            // The unbiased standard deviation, as TRL and verl compute it.
            let var = if rewards.len() > 1 {
                centred.iter().map(|c| c * c).sum::<f64>() / (n - 1.0)
            } else {
                0.0
            };
            let std = var.sqrt();
            centred.iter().map(|c| c / (std + STD_EPSILON)).collect()
        }
    }
}

/// Dynamic sampling (DAPO): a group whose rewards are all equal teaches nothing
/// (every advantage is 0), so it is dropped and more are sampled.
pub fn is_informative(rewards: &[f64]) -> bool {
    rewards
        .iter()
        .any(|r| (r - rewards[0]).abs() > f64::EPSILON * r.abs().max(1.0))
}

/// DAPO's soft overlong punishment for a completion of `length` tokens with a limit of
/// `max_length` and a buffer of `cache` tokens before it: 0 while
/// `length ≤ max_length − cache`, then falling linearly to −1 at `max_length`, and −1
/// beyond.
pub fn overlong_penalty(length: usize, max_length: usize, cache: usize) -> f64 {
    let free = max_length.saturating_sub(cache);
    if length <= free {
        0.0
    } else if length <= max_length && cache > 0 {
        (free as f64 - length as f64) / cache as f64
    } else {
        -1.0
    }
}

/// Overlong filtering: a truncated completion's tokens are masked out of the loss
/// (its reward says nothing about what it would have answered).
pub fn overlong_mask(truncated: bool, tokens: usize) -> Vec<f32> {
    vec![if truncated { 0.0 } else { 1.0 }; tokens]
}

/// On-policy distillation: each token's advantage gains
/// `−coef · (log p_student − log p_teacher)`, the reverse KL to the teacher on the
/// student's own sample, so tokens the teacher finds unlikely are pushed down.
pub fn add_reverse_kl(
    advantages: &mut [f32],
    student_logp: &[f32],
    teacher_logp: &[f32],
    coef: f32,
) {
    for ((a, s), t) in advantages.iter_mut().zip(student_logp).zip(teacher_logp) {
        *a -= coef * (s - t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_advantages_are_centred_and_scaled() {
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], Normalization::Std);
        let sum: f64 = a.iter().sum();
        assert!(sum.abs() < 1e-12);
        // std of [1,0,0,1] (unbiased) = sqrt(1/3).
        assert!((a[0] - 0.5 / (1f64 / 3.0).sqrt()).abs() < 1e-5, "{a:?}");
        assert_eq!(
            group_advantages(&[1.0, 0.0], Normalization::MeanOnly),
            vec![0.5, -0.5]
        );
        assert_eq!(
            group_advantages(&[0.3, 0.3], Normalization::Std),
            vec![0.0, 0.0]
        );
        assert!(!is_informative(&[1.0, 1.0, 1.0]) && is_informative(&[1.0, 0.0]));
    }

    #[test]
    fn the_soft_overlong_penalty_follows_dapo() {
        assert_eq!(overlong_penalty(80, 100, 20), 0.0);
        assert_eq!(overlong_penalty(90, 100, 20), -0.5);
        assert_eq!(overlong_penalty(100, 100, 20), -1.0);
        assert_eq!(overlong_penalty(101, 100, 20), -1.0);
        assert_eq!(overlong_mask(true, 3), vec![0.0; 3]);
    }

    #[test]
    fn reverse_kl_pushes_down_what_the_teacher_finds_unlikely() {
        let mut a = vec![0.0, 0.0];
        add_reverse_kl(&mut a, &[-1.0, -3.0], &[-2.0, -1.0], 0.5);
        assert_eq!(a, vec![-0.5, 1.0]);
    }
}
