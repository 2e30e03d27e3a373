//! Posting an evaluation's summary to its environment's leaderboard on the hub.

use agentstack_hub::api::{LeaderboardPost, PackageRef};
use agentstack_hub::client::{ClientError, HubClient};

use crate::run::Summary;

/// The leaderboard entry for a run: its mean reward with the 95% CI, the episodes,
/// and the configuration hash (prompt profile, context policy, sampling, seed), so
/// entries made the same way can be compared; the whole summary rides along.
pub fn entry(summary: &Summary) -> LeaderboardPost {
    LeaderboardPost {
        model: model_name(&summary.model),
        score: summary.mean_reward,
        ci95: [summary.ci95.0, summary.ci95.1],
        episodes: summary.episodes as u64,
        harness: summary.config_hash.clone(),
        details: serde_json::to_value(summary).unwrap_or_default(),
    }
}

/// How a model is named on a leaderboard: a local file by its file name (its
/// directory says nothing about the model and may say something about the user),
/// anything else as it is.
fn model_name(model: &str) -> String {
    if model.contains("://") {
        return model.to_owned();
    }
    std::path::Path::new(model)
        .file_name()
        .map_or_else(|| model.to_owned(), |n| n.to_string_lossy().into_owned())
}

/// The package a run's environment names (`hub:owner/name@version`), if it is one.
pub fn package_of(env: &str) -> Option<PackageRef> {
    env.starts_with("hub:")
        .then(|| PackageRef::parse(env).ok())
        .flatten()
}

/// Posts `summary` to the leaderboard of `package`'s version.
pub async fn post(
    hub: &HubClient,
    package: &PackageRef,
    summary: &Summary,
) -> Result<(), ClientError> {
    hub.post_result(package, &entry(summary)).await
}

#[cfg(test)]
mod tests {
    #[test]
    fn local_models_are_named_by_their_file() {
        assert_eq!(
            super::model_name("/home/me/models/smol.Q4_1.gguf"),
            "smol.Q4_1.gguf"
        );
        assert_eq!(
            super::model_name("http://127.0.0.1:8080/v1"),
            "http://127.0.0.1:8080/v1"
        );
        assert_eq!(super::model_name("hf:org/repo/file.gguf"), "file.gguf");
    }
}
