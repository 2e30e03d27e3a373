//! Protocol conformance checks for any OpenEnv server (`agentstack env validate`).
//!
//! The first six checks are `openenv validate --url`'s; the rest drive a real session
//! over `/ws`: reset/step/state, the state contract (`episode_id`, `step_count`),
//! rewards finite and within the declared range, the error codes on bad input, and the
//! close handshake.

use std::time::Duration;

use agentstack_protocol::http::ResetRequest;
use agentstack_protocol::ws::{ErrorCode, ServerMessage};
use rand::SeedableRng;
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::client::{ClientConfig, ClientError, EnvClient, HttpClient};
use crate::policy::{self, Policy};

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// It holds.
    Pass,
    /// It does not hold.
    Fail,
    /// Suspicious but allowed.
    Warn,
    /// Not applicable.
    Skip,
}

/// One check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// A stable id, e.g. `health_endpoint`.
    pub id: &'static str,
    /// Its outcome.
    pub status: Status,
    /// What was seen.
    pub detail: String,
}

/// All checks against one server.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The URL checked.
    pub url: String,
    /// Whether every check passed or warned.
    pub passed: bool,
    /// The checks, in order.
    pub checks: Vec<Check>,
}

/// Options of a run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The declared reward range, if known.
    pub reward_range: Option<(f64, f64)>,
    /// Steps to take in the sample episode.
    pub steps: usize,
    /// Time limit per request.
    pub timeout: Duration,
    /// The API key to send, for a server started with keys.
    pub api_key: Option<crate::client::ApiKey>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            reward_range: None,
            steps: 5,
            timeout: Duration::from_secs(30),
            api_key: None,
        }
    }
}

impl Options {
    /// The client limits for the checks' sessions.
    fn client_config(&self) -> ClientConfig {
        ClientConfig {
            message_timeout: self.timeout,
            api_key: self.api_key.clone(),
            ..ClientConfig::default()
        }
    }
}

/// Why the checks could not run.
#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    /// The server could not be reached at all.
    #[error("could not reach {url}")]
    Unreachable {
        /// The URL.
        url: String,
        /// Why.
        #[source]
        source: ClientError,
    },
    /// The server asks for an API key, and none or a wrong one was given
    /// ([`ClientError::Unauthorized`]): its routes cannot be checked.
    #[error(transparent)]
    Unauthorized(ClientError),
}

struct Checks(Vec<Check>);

impl Checks {
    fn add(&mut self, id: &'static str, status: Status, detail: impl Into<String>) {
        self.0.push(Check {
            id,
            status,
            detail: detail.into(),
        });
    }

    fn expect(&mut self, id: &'static str, ok: bool, detail: impl Into<String>) {
        self.add(id, if ok { Status::Pass } else { Status::Fail }, detail);
    }
}

fn is_str(v: &Value, key: &str) -> bool {
    v.get(key).is_some_and(Value::is_string)
}

/// Runs every check against the server at `url`.
pub async fn validate(url: &str, options: &Options) -> Result<Report, ValidateError> {
    let unreachable = |source| ValidateError::Unreachable {
        url: url.to_owned(),
        source,
    };
    let http = HttpClient::from_config(url, &options.client_config()).map_err(unreachable)?;
    let mut checks = Checks(Vec::new());

    // openenv validate --url's six checks.
    let health = http.get_json("/health").await.map_err(unreachable)?;
    // `/health` answers without a key; the first route that needs one says whether
    // the key (or its absence) is accepted.
    let openapi = match http.get_json("/openapi.json").await {
        Err(e @ ClientError::Unauthorized { .. }) => return Err(ValidateError::Unauthorized(e)),
        answer => answer.ok(),
    };
    checks.expect(
        "openapi_version_available",
        openapi
            .as_ref()
            .is_some_and(|(s, v)| *s == 200 && v["info"]["version"].is_string()),
        "GET /openapi.json has info.version",
    );
    checks.expect(
        "health_endpoint",
        health.0 == 200 && health.1["status"] == "healthy",
        format!("GET /health -> {} {}", health.0, health.1),
    );
    let metadata = http.get_json("/metadata").await.ok();
    checks.expect(
        "metadata_endpoint",
        metadata
            .as_ref()
            .is_some_and(|(s, v)| *s == 200 && is_str(v, "name") && is_str(v, "description")),
        "GET /metadata has string name and description",
    );
    let schema = http.get_json("/schema").await.ok();
    let schema_ok = schema.as_ref().is_some_and(|(s, v)| {
        *s == 200
            && ["action", "observation", "state"]
                .iter()
                .all(|k| v[*k].is_object())
    });
    checks.expect(
        "schema_endpoint",
        schema_ok,
        "GET /schema has action, observation and state objects",
    );
    let mcp = http.post_json("/mcp", "{}".into()).await.ok();
    checks.expect(
        "mcp_endpoint",
        mcp.as_ref()
            .is_some_and(|(s, v)| *s == 200 && v["jsonrpc"] == "2.0"),
        format!(
            "POST /mcp {{}} -> {:?}",
            mcp.as_ref().map(|(s, v)| format!("{s} {v}"))
        ),
    );
    let paths = openapi
        .as_ref()
        .and_then(|(_, v)| v["paths"].as_object().cloned())
        .unwrap_or_default();
    let present: Vec<bool> = ["/reset", "/step", "/state"]
        .iter()
        .map(|p| paths.contains_key(*p))
        .collect();
    checks.expect(
        "mode_endpoint_consistency",
        present.iter().all(|&p| p == present[0]),
        format!("/reset, /step, /state present: {present:?}"),
    );

    // A real session.
    let action_schema = schema
        .as_ref()
        .map(|(_, v)| v["action"].clone())
        .unwrap_or_else(|| json!({"type":"object"}));
    session_checks(url, &action_schema, options, &mut checks).await;
    error_checks(url, options, &mut checks).await;

    let passed = checks.0.iter().all(|c| c.status != Status::Fail);
    Ok(Report {
        url: url.to_owned(),
        passed,
        checks: checks.0,
    })
}

fn reward_check(reward: Option<f64>, range: Option<(f64, f64)>) -> Result<(), String> {
    match reward {
        None => Ok(()),
        Some(r) if !r.is_finite() => Err(format!("reward {r} is not finite")),
        Some(r) => match range {
            Some((lo, hi)) if r < lo || r > hi => Err(format!(
                "reward {r} outside the declared range [{lo}, {hi}]"
            )),
            _ => Ok(()),
        },
    }
}

async fn session_checks(url: &str, action_schema: &Value, options: &Options, checks: &mut Checks) {
    let config = options.client_config();
    let mut client = match EnvClient::connect(url, config).await {
        Ok(c) => c,
        Err(e) => {
            checks.add("ws.connect", Status::Fail, format!("WS /ws: {e}"));
            return;
        }
    };
    let episode_id = "agentstack-validate-1";
    let reset = client
        .reset(ResetRequest {
            seed: Some(1),
            episode_id: Some(episode_id.into()),
            options: Map::new(),
        })
        .await;
    let first = match reset {
        Ok(r) => {
            checks.expect(
                "ws.reset",
                reward_check(r.reward, options.reward_range).is_ok(),
                "reset returns an observation",
            );
            r
        }
        Err(e) => {
            checks.add("ws.reset", Status::Fail, e.to_string());
            return;
        }
    };
    match client.state().await {
        Ok(state) => state_contract(
            checks,
            "ws.state_contract.reset",
            &state,
            episode_id,
            0,
            "reset",
        ),
        Err(e) => checks.add("ws.state_contract.reset", Status::Fail, e.to_string()),
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut observation = first.observation;
    let mut steps = 0u64;
    let mut bad_rewards = Vec::new();
    let mut step_errors = Vec::new();
    for _ in 0..options.steps {
        let action = policy::choose(Policy::Random, action_schema, &observation, &mut rng);
        match client.step(&action).await {
            Ok(result) => {
                steps += 1;
                if let Err(e) = reward_check(result.reward, options.reward_range) {
                    bad_rewards.push(e);
                }
                observation = result.observation;
                if result.done {
                    break;
                }
            }
            Err(ClientError::Server(e)) if !e.code.is_fatal() => {
                step_errors.push(format!("{action}: {e}"));
                if e.code == ErrorCode::ValidationError {
                    continue;
                }
                break;
            }
            Err(e) => {
                checks.add("ws.step", Status::Fail, e.to_string());
                return;
            }
        }
    }
    if steps > 0 {
        checks.add(
            "ws.step",
            Status::Pass,
            format!("{steps} steps with schema-generated actions"),
        );
    } else {
        checks.add(
            "ws.step",
            Status::Warn,
            format!(
                "no schema-generated action was accepted: {}",
                step_errors.join("; ")
            ),
        );
    }
    checks.expect(
        "reward_well_formed",
        bad_rewards.is_empty(),
        if bad_rewards.is_empty() {
            match options.reward_range {
                Some((lo, hi)) => format!("rewards finite and within [{lo}, {hi}]"),
                None => "rewards finite (no declared range)".to_owned(),
            }
        } else {
            bad_rewards.join("; ")
        },
    );
    match client.state().await {
        Ok(state) => state_contract(
            checks,
            "ws.state_contract.steps",
            &state,
            episode_id,
            steps,
            &format!("{steps} steps"),
        ),
        Err(e) => checks.add("ws.state_contract.steps", Status::Fail, e.to_string()),
    }
    match client.close().await {
        Ok(()) => checks.add("ws.close", Status::Pass, "close ends the session"),
        Err(e) => checks.add("ws.close", Status::Fail, e.to_string()),
    }
}

/// The state contract after `when`: `step_count` must be `steps` (else it fails);
/// an `episode_id` other than the one given to reset only warns, because many
/// environments (14 of OpenEnv's own) name their episodes themselves and OpenEnv's
/// validator accepts that.
fn state_contract(
    checks: &mut Checks,
    id: &'static str,
    state: &Map<String, Value>,
    episode_id: &str,
    steps: u64,
    when: &str,
) {
    let seen_id = state.get("episode_id");
    let seen_steps = state.get("step_count");
    if seen_steps != Some(&json!(steps)) {
        checks.add(
            id,
            Status::Fail,
            format!(
                "after {when}: step_count {seen_steps:?}, expected {steps} (episode_id {seen_id:?})"
            ),
        );
    } else if seen_id != Some(&json!(episode_id)) {
        checks.add(
            id,
            Status::Warn,
            format!(
                "after {when}: step_count {steps}, but episode_id {seen_id:?} is the environment's own, not {episode_id:?} given to reset (OpenEnv's validator accepts this)"
            ),
        );
    } else {
        checks.add(
            id,
            Status::Pass,
            format!("after {when}: episode_id {episode_id:?}, step_count {steps}"),
        );
    }
}

async fn error_checks(url: &str, options: &Options, checks: &mut Checks) {
    let config = options.client_config();
    let mut client = match EnvClient::connect(url, config.clone()).await {
        Ok(c) => c,
        Err(e) => {
            checks.add("ws.errors", Status::Fail, e.to_string());
            return;
        }
    };
    let cases: [(&'static str, &str, ErrorCode); 4] = [
        ("ws.error.invalid_json", "{not json", ErrorCode::InvalidJson),
        (
            "ws.error.unknown_type",
            r#"{"type":"jump"}"#,
            ErrorCode::UnknownType,
        ),
        (
            "ws.error.extra_key",
            r#"{"type":"state","bogus":1}"#,
            ErrorCode::ValidationError,
        ),
        (
            "ws.error.missing_data",
            r#"{"type":"step"}"#,
            ErrorCode::ValidationError,
        ),
    ];
    for (id, frame, want) in cases {
        match client.request_raw(frame.to_owned()).await {
            Ok(ServerMessage::Error(e)) if e.code == want => {
                checks.add(id, Status::Pass, format!("{frame} -> {}", e.code))
            }
            Ok(other) => checks.add(
                id,
                Status::Fail,
                format!("{frame} -> {}, expected {want}", other.to_json()),
            ),
            Err(e) => {
                checks.add(id, Status::Fail, format!("{frame} -> {e}"));
                return;
            }
        }
    }
    match client.state().await {
        Ok(_) => checks.add(
            "ws.error.recoverable",
            Status::Pass,
            "the session works after recoverable errors",
        ),
        Err(e) => checks.add("ws.error.recoverable", Status::Fail, e.to_string()),
    }
    let _ = client.close().await;
    match EnvClient::attach(url, "agentstack-validate-no-such-session", config).await {
        Ok(mut c) => match c.receive().await {
            Ok(ServerMessage::Error(e)) if e.code == ErrorCode::SessionError => {
                checks.add("ws.error.unknown_session", Status::Pass, e.message)
            }
            other => checks.add(
                "ws.error.unknown_session",
                Status::Fail,
                format!("expected SESSION_ERROR, got {other:?}"),
            ),
        },
        Err(e) => checks.add(
            "ws.error.unknown_session",
            Status::Warn,
            match std::error::Error::source(&e) {
                Some(cause) => format!("connection refused outright: {e}: {cause}"),
                None => format!("connection refused outright: {e}"),
            },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contract(state: Value, steps: u64) -> Check {
        let mut checks = Checks(Vec::new());
        let state = state.as_object().unwrap().clone();
        state_contract(
            &mut checks,
            "ws.state_contract.steps",
            &state,
            "given",
            steps,
            "test",
        );
        checks.0.remove(0)
    }

    #[test]
    fn an_environment_naming_its_own_episodes_only_warns() {
        let check = contract(json!({"episode_id": "its-own", "step_count": 2}), 2);
        assert_eq!(check.status, Status::Warn, "{}", check.detail);
        assert!(check.detail.contains("its-own"), "{}", check.detail);
    }

    #[test]
    fn a_wrong_step_count_fails_whatever_the_episode_id() {
        for id in ["given", "its-own"] {
            let check = contract(json!({"episode_id": id, "step_count": 1}), 2);
            assert_eq!(check.status, Status::Fail, "{}", check.detail);
        }
        let check = contract(json!({"episode_id": "given", "step_count": 2}), 2);
        assert_eq!(check.status, Status::Pass, "{}", check.detail);
    }
}
