//! `env run` against an environment shaped like OpenEnv's atari (issue 20): the move is
//! `action_id`, the legal ones are listed in `legal_actions`, and any other id is an
//! error. The environment is served by our real server on 127.0.0.1:0; the binary
//! drives it.

use std::process::{Command, Output};
use std::time::Duration;

use agentstack_env::server::{Server, ServerConfig};
use agentstack_env::{
    BoxFuture, DynEnvironment, EnvError, EnvInfo, EnvSpec, StepError, StepJson, ToolCallError,
};
use agentstack_protocol::http::{ResetRequest, SchemaResponse};
use agentstack_protocol::mcp::{CallToolResult, ToolSpec};
use agentstack_protocol::ws::StepResult;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

/// The ids the arcade accepts; the policy's unguided draw (0..=9) hits none of them.
const LEGAL: [i64; 2] = [11, 17];
/// Steps in an arcade episode.
const EPISODE_STEPS: u64 = 5;
/// The step at which an episode whose seed is the `crash_seed` reset option fails.
const CRASH_STEP: u64 = 2;
/// The most one `env run` here may take.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// An atari-like environment: `{"action_id": int}`, `legal_actions` in every
/// observation, "Invalid action_id" for anything else.
#[derive(Default)]
struct Arcade {
    steps: u64,
    crashes: bool,
}

impl Arcade {
    fn observation(&self, reward: Option<f64>) -> Result<StepJson, EnvError> {
        let done = self.steps >= EPISODE_STEPS;
        let observation = json!({"legal_actions": if done { vec![] } else { LEGAL.to_vec() }});
        Ok(StepResult {
            observation: serde_json::value::to_raw_value(&observation)
                .map_err(|e| EnvError::new(e.to_string()))?,
            reward,
            done,
            metadata: None,
        })
    }

    fn spec() -> EnvSpec {
        let schema = SchemaResponse {
            action: json!({
                "type": "object", "title": "AtariAction", "required": ["action_id"],
                "properties": {
                    "action_id": {"type": "integer", "title": "Action Id"},
                    "game_name": {"type": "string", "default": "pong"},
                    "metadata": {"type": "object"}
                }
            }),
            observation: json!({"type": "object", "properties": {
                "legal_actions": {"type": "array", "items": {"type": "integer"}}}}),
            state: json!({"type": "object"}),
            reset_observation: None,
        };
        EnvSpec::from_parts(
            EnvInfo::new("arcade", "Press a legal button"),
            schema,
            || Ok(Box::new(Arcade::default()) as Box<dyn DynEnvironment>),
            None,
        )
    }
}

impl DynEnvironment for Arcade {
    fn reset(&mut self, request: ResetRequest) -> BoxFuture<'_, Result<StepJson, EnvError>> {
        self.steps = 0;
        self.crashes = request.seed.is_some()
            && request.options.get("crash_seed").and_then(Value::as_u64) == request.seed;
        Box::pin(async move { self.observation(None) })
    }

    fn step<'a>(&'a mut self, action: &'a RawValue) -> BoxFuture<'a, Result<StepJson, StepError>> {
        Box::pin(async move {
            let action: Value =
                serde_json::from_str(action.get()).map_err(|e| EnvError::new(e.to_string()))?;
            let id = action["action_id"].as_i64().unwrap_or(-1);
            if !LEGAL.contains(&id) {
                return Err(EnvError::new(format!(
                    "Invalid action_id {id}; legal actions: {LEGAL:?}"
                ))
                .into());
            }
            self.steps += 1;
            if self.crashes && self.steps == CRASH_STEP {
                return Err(EnvError::new("the emulator crashed").into());
            }
            Ok(self.observation(Some(if id == LEGAL[1] { 1.0 } else { 0.0 }))?)
        })
    }

    fn state(&self) -> Result<Map<String, Value>, EnvError> {
        Ok(Map::new())
    }

    fn tools(&self) -> Vec<ToolSpec> {
        Vec::new()
    }

    fn call_tool<'a>(
        &'a mut self,
        name: &'a str,
        _arguments: Map<String, Value>,
    ) -> BoxFuture<'a, Result<CallToolResult, ToolCallError>> {
        Box::pin(async move { Err(ToolCallError::NotFound(name.to_owned())) })
    }
}

/// Serves the arcade, runs `agentstack env run <url> <args>` with the environment
/// `vars` set, and returns what the binary did. Colour variables are cleared first so
/// that only `vars` decide.
fn run_against_arcade(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt
        .block_on(Server::bind(ServerConfig::default(), vec![Arcade::spec()]))
        .unwrap();
    let url = server.url();
    let handle = server.handle();
    rt.spawn(server.serve());
    let home = tempfile::tempdir().unwrap();
    let mut command = Command::new(super::bin());
    command
        .args(["env", "run", &url])
        .args(args)
        .env("HOME", home.path())
        .env("AGENTSTACK_HOME", home.path().join("data"))
        .env_remove("AGENTSTACK_LOG")
        .env_remove("NO_COLOR")
        .env_remove("CLICOLOR_FORCE");
    for (name, value) in vars {
        command.env(name, value);
    }
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let output = rt.block_on(async {
        tokio::time::timeout(
            RUN_LIMIT,
            tokio::task::spawn_blocking(move || child.wait_with_output()),
        )
        .await
    });
    handle.shutdown();
    match output {
        Ok(output) => output.unwrap().unwrap(),
        Err(_) => {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("env run took more than {RUN_LIMIT:?}");
        }
    }
}

fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn json_lines(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Regression (issue 20): the random policy filled only a field named `action` from
/// `legal_actions`, so atari's `action_id` got any integer and the run stopped on
/// "Invalid action_id".
#[test]
fn random_policy_plays_legal_action_ids() {
    for policy in ["random", "scripted"] {
        let out = run_against_arcade(&["-n", "4", "--json", "--policy", policy], &[]);
        assert_eq!(out.status.code(), Some(0), "{policy}: {}", describe(&out));
        let episodes = json_lines(&out);
        assert_eq!(episodes.len(), 4, "{}", describe(&out));
        for e in &episodes {
            assert_eq!(e["error"], Value::Null, "{e}");
            assert_eq!(e["steps"], EPISODE_STEPS, "{e}");
            assert_eq!(e["done"], true, "{e}");
        }
    }
}

/// Regression (issue 20): the first failing step stopped the whole run and printed no
/// episode at all. Now the failing episode ends with its error recorded, the others
/// run, and the exit status is 1.
#[test]
fn a_failed_episode_is_recorded_and_the_run_goes_on() {
    let crash = r#"{"crash_seed": 1}"#;
    let out = run_against_arcade(&["-n", "3", "--json", "--options", crash], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let episodes = json_lines(&out);
    assert_eq!(episodes.len(), 3, "{}", describe(&out));
    for e in [&episodes[0], &episodes[2]] {
        assert_eq!(e["error"], Value::Null, "{e}");
        assert_eq!(e["steps"], EPISODE_STEPS, "{e}");
    }
    let failed = &episodes[1];
    let error = failed["error"].as_str().unwrap_or_default();
    assert!(error.contains("the emulator crashed"), "{failed}");
    assert_eq!(failed["steps"], CRASH_STEP - 1, "{failed}");
    assert_eq!(failed["done"], false, "{failed}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("1 of 3 episodes failed"), "{stderr}");

    // The table names the failure and averages the episodes that finished.
    let out = run_against_arcade(&["-n", "3", "--options", crash], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("episode 1 failed: "), "{stdout}");
    assert!(stdout.contains("(95% CI ["), "{stdout}");
    assert!(stdout.contains("over 2 episodes"), "{stdout}");
}

/// Regression (issue 20): log lines carried ANSI colour codes into files and pipes.
/// Colour only when stderr is a terminal, unless CLICOLOR_FORCE asks for it and
/// NO_COLOR does not forbid it.
#[test]
fn logs_to_a_pipe_have_no_colour_codes() {
    const ESC: u8 = 0x1b;
    let args = ["-n", "2", "--options", r#"{"crash_seed": 0}"#];
    let has_escape = |out: &Output| out.stderr.contains(&ESC);

    let piped = run_against_arcade(&args, &[]);
    let stderr = String::from_utf8_lossy(&piped.stderr);
    assert!(stderr.contains("episode failed"), "{}", describe(&piped));
    assert!(!has_escape(&piped), "{stderr:?}");

    let forced = run_against_arcade(&args, &[("CLICOLOR_FORCE", "1")]);
    assert!(has_escape(&forced), "{}", describe(&forced));

    let forbidden = run_against_arcade(&args, &[("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")]);
    assert!(!has_escape(&forbidden), "{}", describe(&forbidden));
}
