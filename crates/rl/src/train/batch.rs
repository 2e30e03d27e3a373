//! What a step learns from: the samples of its episodes (or SFT's examples), their
//! rewards turned into per-token advantages and masks.

use std::collections::BTreeMap;
use std::fs;
use std::time::Instant;

use agentstack_model::LanguageModel;

use super::error::io;
use super::rollout::shuffled;
use super::{Sample, StepMetrics, TrainError};
use crate::advantage::{
    add_reverse_kl, group_advantages, is_informative, overlong_mask, overlong_penalty,
};
use crate::config::TrainConfig;

/// Samples with their per-token advantages and loss masks.
pub(super) type Shaped = (Vec<Sample>, Vec<Vec<f32>>, Vec<Vec<f32>>);

/// The samples of played episodes: one per episode, whose completion runs from its
/// first model turn to its last. A later turn whose prompt continues the previous
/// turn's prompt and completion ids (the in-process engine keeps them) adds the ids in
/// between (the environment's reply, the chat template's markers; masked out, with
/// log-probability 0) and its own completion: the episode is learned from end to end,
/// on the ids the policy saw and sampled, and counts once in its group. A turn that
/// does not continue (the history was tokenized again or cut) starts a sample of its
/// own.
pub(super) fn samples_of(episodes: &[(usize, agentstack_harness::Episode)]) -> Vec<Sample> {
    let mut samples = Vec::new();
    for (group, episode) in episodes {
        let mut current: Option<Sample> = None;
        for turn in &episode.turns {
            let Some((prompt, completion, logprobs)) = turn.tokens.complete() else {
                samples.extend(current.take());
                continue;
            };
            let versions = turn.tokens.weights_versions.clone().unwrap_or_default();
            let truncated = turn.finish_reason == "length";
            if let Some(s) = &mut current
                && let Some(between) = between(&s.prompt, &s.completion, prompt)
            {
                match s.versions.last() {
                    Some(&last) if versions.len() == completion.len() => {
                        s.versions.extend(std::iter::repeat_n(last, between.len()));
                        s.versions.extend(&versions);
                    }
                    _ => s.versions.clear(),
                }
                if s.mask.is_empty() {
                    s.mask = vec![1.0; s.completion.len()];
                }
                s.mask.extend(std::iter::repeat_n(0.0, between.len()));
                s.mask.extend(std::iter::repeat_n(1.0, completion.len()));
                s.logprobs.extend(std::iter::repeat_n(0.0, between.len()));
                s.logprobs.extend_from_slice(logprobs);
                s.completion.extend_from_slice(between);
                s.completion.extend_from_slice(completion);
                s.truncated = truncated;
                continue;
            }
            samples.extend(current.take());
            if completion.is_empty() {
                continue;
            }
            current = Some(Sample {
                group: *group,
                prompt: prompt.to_vec(),
                completion: completion.to_vec(),
                logprobs: logprobs.to_vec(),
                versions,
                mask: Vec::new(),
                reward: episode.reward,
                truncated,
            });
        }
        samples.extend(current);
    }
    samples
}

/// The ids `next_prompt` has after `prompt` and `completion`, when it begins with all
/// of them (a turn that continues the previous one's token ids).
fn between<'a>(prompt: &[u32], completion: &[u32], next_prompt: &'a [u32]) -> Option<&'a [u32]> {
    let (p, c) = (prompt.len(), completion.len());
    (next_prompt.len() >= p + c
        && next_prompt[..p] == *prompt
        && next_prompt[p..p + c] == *completion)
        .then(|| &next_prompt[p + c..])
}

/// Multi-turn episodes' later turns, and how many of them do not continue the
/// previous turn's token ids (their prompt does not begin with the previous turn's
/// prompt and completion: the history was tokenized again, or cut).
pub(super) fn continuations(episodes: &[(usize, agentstack_harness::Episode)]) -> (usize, usize) {
    let (mut later, mut broken) = (0, 0);
    for (_, episode) in episodes {
        for pair in episode.turns.windows(2) {
            let (Some((prompt, completion, _)), Some((next, _, _))) =
                (pair[0].tokens.complete(), pair[1].tokens.complete())
            else {
                continue;
            };
            later += 1;
            if between(prompt, completion, next).is_none() {
                broken += 1;
            }
        }
    }
    (later, broken)
}

pub(super) fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Rewards → per-token advantages and masks (group normalisation, dynamic sampling,
/// overlong handling, distillation's reverse KL).
pub(super) fn shape(
    config: &TrainConfig,
    samples: Vec<Sample>,
    normalization: crate::advantage::Normalization,
    teacher: Option<&LanguageModel>,
    m: &mut StepMetrics,
) -> Result<Shaped, TrainError> {
    let mut by_group: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        by_group.entry(s.group).or_default().push(i);
    }
    let max_tokens = config.rollout.max_tokens;
    let reward_of = |s: &Sample| -> f64 {
        match config.loss.overlong.as_str() {
            "penalty" => {
                s.reward
                    + overlong_penalty(s.completion.len(), max_tokens, config.loss.overlong_cache)
            }
            _ => s.reward,
        }
    };
    let reward_weight = config.distill.as_ref().map_or(1.0, |d| d.reward_weight);
    let mut kept = Vec::new();
    let mut advantages = Vec::new();
    let mut masks = Vec::new();
    let mut reverse_kl = (0.0, 0usize);
    for members in by_group.values() {
        let rewards: Vec<f64> = members.iter().map(|&i| reward_of(&samples[i])).collect();
        let informative = is_informative(&rewards);
        if config.loss.dynamic_sampling && !informative && teacher.is_none() {
            continue;
        }
        m.groups_kept += 1;
        let group_adv = group_advantages(&rewards, normalization);
        let teacher_logps = match teacher {
            Some(teacher) => {
                let t = Instant::now();
                let scored = teacher_logprobs(teacher, members.iter().map(|&i| &samples[i]))?;
                m.teacher_s = Some(m.teacher_s.unwrap_or(0.0) + t.elapsed().as_secs_f64());
                scored
            }
            None => Vec::new(),
        };
        for (k, (&i, a)) in members.iter().zip(group_adv).enumerate() {
            let s = &samples[i];
            let a = if teacher.is_some() {
                a * reward_weight
            } else {
                a
            };
            let mut adv = vec![a as f32; s.completion.len()];
            if let (Some(teacher_logp), Some(d)) = (teacher_logps.get(k), &config.distill) {
                for (st, te) in s.logprobs.iter().zip(teacher_logp) {
                    reverse_kl.0 += f64::from(st - te);
                    reverse_kl.1 += 1;
                }
                add_reverse_kl(&mut adv, &s.logprobs, teacher_logp, d.kl_coef as f32);
            }
            let mut mask = match config.loss.overlong.as_str() {
                "filter" => overlong_mask(s.truncated, s.completion.len()),
                _ => vec![1.0; s.completion.len()],
            };
            if s.mask.len() == mask.len() {
                for (m, own) in mask.iter_mut().zip(&s.mask) {
                    *m *= own;
                }
            }
            kept.push(s.clone());
            advantages.push(adv);
            masks.push(mask);
        }
    }
    if teacher.is_some() {
        m.reverse_kl = Some(reverse_kl.0 / reverse_kl.1.max(1) as f64);
    }
    Ok((kept, advantages, masks))
}

/// The teacher's log-probability of every completion token of `samples`: the
/// completions of one prompt (a GRPO group's) scored together, the prompt read once.
fn teacher_logprobs<'a>(
    teacher: &LanguageModel,
    samples: impl Iterator<Item = &'a Sample>,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let samples: Vec<&Sample> = samples.collect();
    let mut out = vec![Vec::new(); samples.len()];
    let mut done = vec![false; samples.len()];
    for i in 0..samples.len() {
        if done[i] {
            continue;
        }
        let same: Vec<usize> = (i..samples.len())
            .filter(|&j| !done[j] && samples[j].prompt == samples[i].prompt)
            .collect();
        let completions: Vec<&[u32]> = same
            .iter()
            .map(|&j| samples[j].completion.as_slice())
            .collect();
        let scored = teacher
            .score_completions(&samples[i].prompt, &completions)
            .map_err(|source| TrainError::Model {
                what: "the teacher scoring the samples",
                source: Box::new(source),
            })?;
        for (j, lp) in same.into_iter().zip(scored) {
            out[j] = lp;
            done[j] = true;
        }
    }
    Ok(out)
}

/// SFT's examples: every model turn of the episodes with at least `min_reward` in
/// the given eval runs, exactly as the engine sampled them.
pub(super) fn sft_data(config: &TrainConfig) -> Result<Vec<Sample>, TrainError> {
    let sft = config.sft.as_ref().ok_or_else(|| {
        TrainError::Config(
            "train sft needs an [sft] section with runs = [\"runs/<eval run>\"]".into(),
        )
    })?;
    let mut samples = Vec::new();
    for run in &sft.runs {
        let path = run.join("results.jsonl");
        let text = fs::read_to_string(&path).map_err(io(&path))?;
        for (n, line) in text.lines().enumerate() {
            let record: agentstack_harness::run::EpisodeRecord = serde_json::from_str(line)
                .map_err(|source| TrainError::Json {
                    path: path.clone(),
                    line: Some(n + 1),
                    source,
                })?;
            if record.episode.reward < sft.min_reward {
                continue;
            }
            let episode = [(0usize, record.episode)];
            samples.extend(samples_of(&episode));
        }
    }
    if samples.is_empty() {
        return Err(TrainError::Config(format!(
            "no episode with reward ≥ {} and token ids in {:?}; run eval with an in-process model (it records token ids), or lower sft.min_reward",
            sft.min_reward, sft.runs
        )));
    }
    Ok(samples)
}

pub(super) fn sft_batch(data: &[Sample], config: &TrainConfig, step: usize) -> Vec<Sample> {
    let size = config.sft.as_ref().map_or(8, |s| s.batch_size).max(1);
    let n = data.len();
    (0..size)
        .map(|j| data[shuffled(&[config.seed, 0x5f7], n, (step * size + j) as u64)].clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// An episode of turns with these (prompt, completion) ids, as the harness writes it.
    fn episode(turns: &[(&[u32], &[u32])]) -> agentstack_harness::Episode {
        let turns: Vec<_> = turns
            .iter()
            .map(|(prompt, completion)| {
                json!({"kind": "act", "prompt_ids": prompt, "completion_ids": completion,
                       "logprobs": vec![-1.0; completion.len()], "text": "", "finish_reason": "stop",
                       "prompt_tokens": prompt.len(), "completion_tokens": completion.len()})
            })
            .collect();
        serde_json::from_value(
            json!({"reset": {}, "reward": 1.0, "finish": "done", "steps": 1,
            "parse_errors": 0, "invalid_actions": 0, "turns": turns, "messages": []}),
        )
        .unwrap()
    }

    /// A later turn counts as continued when its prompt begins with the previous turn's
    /// prompt and completion ids, and as tokenized again otherwise; single turns do not
    /// count.
    #[test]
    fn later_turns_that_do_not_continue_the_ids_are_counted() {
        let episodes = [
            (
                0,
                episode(&[
                    (&[1, 2], &[3, 4]),
                    (&[1, 2, 3, 4, 5], &[6]),
                    (&[1, 2, 3, 4, 5, 6, 7], &[8]),
                ]),
            ),
            // The history tokenized again: 3 4 became 9.
            (0, episode(&[(&[1, 2], &[3, 4]), (&[1, 2, 9, 5], &[6])])),
            // Shorter than what it should continue.
            (1, episode(&[(&[1, 2], &[3, 4]), (&[1, 2], &[6])])),
            (1, episode(&[(&[1, 2], &[3])])),
        ];
        assert_eq!(continuations(&episodes), (4, 2));
    }

    /// A multi-turn episode whose turns continue each other is one sample: the ids in
    /// between are masked, with log-probability 0; a turn that does not continue starts
    /// a sample of its own; each sample keeps its group and reward.
    #[test]
    fn an_episode_of_continued_turns_is_one_sample() {
        let episodes = [
            (
                0,
                episode(&[
                    (&[1, 2], &[3, 4]),
                    (&[1, 2, 3, 4, 5], &[6]),
                    (&[1, 2, 3, 4, 5, 6, 7], &[8]),
                ]),
            ),
            (1, episode(&[(&[1, 2], &[3, 4]), (&[1, 2, 9, 5], &[6])])),
        ];
        let samples = samples_of(&episodes);
        assert_eq!(samples.len(), 3);
        let whole = &samples[0];
        assert_eq!((whole.group, whole.prompt.as_slice()), (0, &[1, 2][..]));
        assert_eq!(whole.completion, [3, 4, 5, 6, 7, 8]);
        assert_eq!(whole.mask, [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]);
        assert_eq!(whole.logprobs, [-1.0, -1.0, 0.0, -1.0, 0.0, -1.0]);
        assert_eq!(
            (samples[1].completion.as_slice(), samples[1].mask.as_slice()),
            (&[3, 4][..], &[][..])
        );
        assert_eq!(
            (samples[2].group, samples[2].prompt.as_slice()),
            (1, &[1, 2, 9, 5][..])
        );
    }
}
