//! Held-out evaluations during training.

use std::path::Path;

use agentstack_harness::episode::LoopConfig;
use agentstack_harness::{
    ContextPolicy, EnvHandle, EvalConfig, ModelClient, Profile, Run, Sampling,
};

use super::TrainError;
use crate::config::TrainConfig;

/// Held-out evaluation of the adapters now in the engine, as an `eval` run in
/// `<run>/eval/step-<k>` (resumable, like any eval run).
pub(super) async fn eval_at(
    config: &TrainConfig,
    dir: &Path,
    env: Option<&EnvHandle>,
    model: &ModelClient,
    step: usize,
) -> Result<(f64, (f64, f64)), TrainError> {
    let env = env.ok_or_else(|| TrainError::Config("evaluation needs an environment".into()))?;
    let split = config
        .eval
        .split
        .clone()
        .filter(|s| !s.is_empty() && env.tasks().is_some());
    let eval = EvalConfig {
        env: config.env.clone(),
        model: config.model.display().to_string(),
        tasks: config.eval.episodes,
        samples: 1,
        seed: config.eval.seed,
        split,
        reset_options: config.env_options.clone(),
        play: LoopConfig {
            max_turns: config.rollout.max_turns,
            sampling: Sampling {
                temperature: config.eval.temperature,
                top_p: 1.0,
                max_tokens: config.rollout.max_tokens,
            },
            context: ContextPolicy::default(),
            constrain: false,
        },
        profile: config
            .profile
            .clone()
            .unwrap_or_else(|| Profile::for_env(env.name())),
        success_threshold: 1.0,
    };
    let run_dir = dir.join("eval").join(format!("step-{step:06}"));
    let eval_error = |source| TrainError::Eval {
        dir: run_dir.clone(),
        source: Box::new(source),
    };
    let run = Run::open(&run_dir, eval, config.rollout.concurrency, false).map_err(eval_error)?;
    let summary = run.play(model, env, |_| {}).await.map_err(eval_error)?;
    Ok((summary.mean_reward, summary.ci95))
}
