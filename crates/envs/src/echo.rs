//! `echo`: sends every message straight back. The same environment as the one
//! `openenv init` generates, plus the two MCP tools of OpenEnv's MCP echo
//! environment, so clients and servers can be checked against a peer with nothing
//! else in the way.
//!
//! - action `{"message": str}`;
//! - observation `{"echoed_message": str, "message_length": int}`;
//! - reward `min(0.1 × characters, 1.0)`; an episode never ends;
//! - tools `echo_message(message) -> str` and
//!   `echo_with_length(message) -> {"message": str, "length": int}`.

use agentstack_env::{EnvError, EnvInfo, EnvSpec, Environment, ResetArgs, Step, ToolCallError};
use agentstack_protocol::mcp::ToolSpec;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// The name the environment is served under.
pub const NAME: &str = "echo";

/// What `echoed_message` says after a reset.
pub const READY_MESSAGE: &str = "Echo environment ready!";

/// Reward per character of the message, before the cap at 1.0.
const REWARD_PER_CHAR: f64 = 0.1;

const README: &str = r#"# echo

Echoes every message back. Mirrors the environment `openenv init` generates and the
tools of OpenEnv's MCP echo environment; useful to check clients, servers and
harnesses end to end.

## Action

```json
{"message": "hello"}
```

## Observation

```json
{"echoed_message": "hello", "message_length": 5,
 "metadata": {"original_message": "hello", "step": 1}}
```

After a reset `echoed_message` is `"Echo environment ready!"` and `message_length` is 0.

## Reward

`min(0.1 × number of characters, 1.0)`; 0.0 at reset. Episodes never end.

## Tools (MCP)

- `echo_message(message: str) -> str` returns the message.
- `echo_with_length(message: str) -> {"message": str, "length": int}`.

## Reset options

None; the seed is accepted and has no effect.
"#;

/// Echo's action.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EchoAction {
    /// The message to echo back.
    pub message: String,
}

/// Echo's observation.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct EchoObservation {
    /// The message that was sent, unchanged.
    pub echoed_message: String,
    /// Its length in characters (Unicode scalar values).
    pub message_length: usize,
}

/// Echo keeps no state beyond what the host tracks.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct EchoState {}

/// The arguments of both echo tools.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct MessageArgs {
    /// The message to echo.
    message: String,
}

/// The echo environment.
#[derive(Debug, Clone, Default)]
pub struct EchoEnv {
    steps: u64,
}

impl EchoEnv {
    /// A fresh environment.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The spec that serves [`EchoEnv`].
pub fn spec() -> EnvSpec {
    EnvSpec::new(EchoEnv::new)
}

/// The reward for a message of `length` characters.
pub fn reward_for_length(length: usize) -> f64 {
    // Lengths are far below 2^53, so the cast is exact.
    (length as f64 * REWARD_PER_CHAR).min(1.0)
}

/// The input schema of a tool taking `T`: an object schema without the
/// `$schema`/`title` keys a root schema carries.
fn tool_input_schema<T: JsonSchema>() -> Value {
    let mut schema = schemars::schema_for!(T);
    schema.remove("$schema");
    schema.remove("title");
    schema.to_value()
}

fn message_arg(arguments: Map<String, Value>) -> Result<String, ToolCallError> {
    serde_json::from_value::<MessageArgs>(Value::Object(arguments))
        .map(|args| args.message)
        .map_err(|e| ToolCallError::InvalidArgs(format!("expected {{\"message\": string}}: {e}")))
}

impl Environment for EchoEnv {
    type Action = EchoAction;
    type Observation = EchoObservation;
    type State = EchoState;

    fn info(&self) -> EnvInfo {
        EnvInfo {
            readme: Some(README.to_owned()),
            ..EnvInfo::new(
                NAME,
                "Echoes each message back; reward grows with its length",
            )
        }
    }

    async fn reset(&mut self, _args: ResetArgs) -> Result<Step<EchoObservation>, EnvError> {
        self.steps = 0;
        Ok(Step::new(EchoObservation {
            echoed_message: READY_MESSAGE.to_owned(),
            message_length: 0,
        })
        .with_reward(0.0))
    }

    async fn step(&mut self, action: EchoAction) -> Result<Step<EchoObservation>, EnvError> {
        self.steps += 1;
        let length = action.message.chars().count();
        Ok(Step::new(EchoObservation {
            echoed_message: action.message.clone(),
            message_length: length,
        })
        .with_reward(reward_for_length(length))
        .with_metadata("original_message", action.message)
        .with_metadata("step", self.steps))
    }

    fn state(&self) -> EchoState {
        EchoState {}
    }

    fn tools(&self) -> Vec<ToolSpec> {
        vec![
            ToolSpec {
                name: "echo_message".to_owned(),
                description: "Echo back the provided message.".to_owned(),
                input_schema: tool_input_schema::<MessageArgs>(),
            },
            ToolSpec {
                name: "echo_with_length".to_owned(),
                description: "Echo back the message with its length in characters.".to_owned(),
                input_schema: tool_input_schema::<MessageArgs>(),
            },
        ]
    }

    async fn call_tool(
        &mut self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<Value, ToolCallError> {
        match name {
            "echo_message" => Ok(Value::String(message_arg(arguments)?)),
            "echo_with_length" => {
                let message = message_arg(arguments)?;
                let length = message.chars().count();
                Ok(json!({"message": message, "length": length}))
            }
            other => Err(ToolCallError::NotFound(other.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use agentstack_protocol::http::ResetRequest;
    use serde_json::value::RawValue;

    use super::*;

    const TOLERANCE: f64 = 1e-12;

    fn args(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!("tests pass objects"),
        }
    }

    #[tokio::test]
    async fn reset_says_ready_with_zero_reward() {
        let mut env = EchoEnv::new();
        let step = env.reset(ResetArgs::default()).await.unwrap();
        assert_eq!(step.observation.echoed_message, READY_MESSAGE);
        assert_eq!(step.observation.message_length, 0);
        assert_eq!(step.reward, Some(0.0));
        assert!(!step.done);
    }

    #[tokio::test]
    async fn step_echoes_and_rewards_by_characters() {
        let mut env = EchoEnv::new();
        env.reset(ResetArgs::default()).await.unwrap();
        let step = env
            .step(EchoAction {
                message: "héllo".into(),
            })
            .await
            .unwrap();
        assert_eq!(step.observation.echoed_message, "héllo");
        assert_eq!(step.observation.message_length, 5);
        assert!((step.reward.unwrap() - 0.5).abs() < TOLERANCE);
        assert!(!step.done);
        assert_eq!(step.metadata["original_message"], "héllo");
        assert_eq!(step.metadata["step"], 1);

        let long = env
            .step(EchoAction {
                message: "x".repeat(40),
            })
            .await
            .unwrap();
        assert!((long.reward.unwrap() - 1.0).abs() < TOLERANCE);
        assert_eq!(long.metadata["step"], 2);

        let empty = env
            .step(EchoAction {
                message: String::new(),
            })
            .await
            .unwrap();
        assert!(empty.reward.unwrap().abs() < TOLERANCE);
    }

    #[tokio::test]
    async fn tools_echo_and_measure() {
        let mut env = EchoEnv::new();
        let names: Vec<_> = env.tools().into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["echo_message", "echo_with_length"]);
        let schema = &env.tools()[0].input_schema;
        assert_eq!(schema["type"], "object");
        assert_eq!(schema["required"], json!(["message"]));
        assert_eq!(schema["properties"]["message"]["type"], "string");
        assert!(schema.get("$schema").is_none());

        let value = env
            .call_tool("echo_message", args(json!({"message": "hi"})))
            .await
            .unwrap();
        assert_eq!(value, json!("hi"));
        let value = env
            .call_tool("echo_with_length", args(json!({"message": "héllo"})))
            .await
            .unwrap();
        assert_eq!(value, json!({"message": "héllo", "length": 5}));
    }

    #[tokio::test]
    async fn tool_errors_say_what_is_wrong() {
        let mut env = EchoEnv::new();
        let missing = env.call_tool("echo_message", Map::new()).await.unwrap_err();
        assert!(
            matches!(&missing, ToolCallError::InvalidArgs(m) if m.contains("message")),
            "{missing:?}"
        );
        let wrong_type = env
            .call_tool("echo_with_length", args(json!({"message": 3})))
            .await
            .unwrap_err();
        assert!(
            matches!(wrong_type, ToolCallError::InvalidArgs(_)),
            "{wrong_type:?}"
        );
        let unknown = env.call_tool("shout", Map::new()).await.unwrap_err();
        assert_eq!(unknown, ToolCallError::NotFound("shout".into()));
    }

    #[tokio::test]
    async fn wire_form_through_spec() {
        let spec = spec();
        assert_eq!(spec.name(), NAME);
        assert_eq!(spec.info().reward_range, (0.0, 1.0));
        let schema = &spec.schema().action;
        assert_eq!(schema["required"], json!(["message"]));
        assert!(schema["properties"]["message"]["description"].is_string());

        let mut env = spec.instantiate().unwrap();
        let reset = env.reset(ResetRequest::default()).await.unwrap();
        let obs: Value = serde_json::from_str(reset.observation.get()).unwrap();
        assert_eq!(obs["echoed_message"], READY_MESSAGE);
        assert_eq!(obs["message_length"], 0);

        let action = RawValue::from_string(r#"{"message":"hey"}"#.into()).unwrap();
        let step = env.step(&action).await.unwrap();
        let obs: Value = serde_json::from_str(step.observation.get()).unwrap();
        assert_eq!(obs["echoed_message"], "hey");
        assert_eq!(obs["message_length"], 3);
        assert_eq!(obs["metadata"]["original_message"], "hey");
        assert!(!step.done);

        let state = env.state().unwrap();
        assert_eq!(state["step_count"], 1);

        let extra = RawValue::from_string(r#"{"message":"hey","loud":true}"#.into()).unwrap();
        assert!(env.step(&extra).await.is_err());
    }
}
