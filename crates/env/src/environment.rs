//! The [`Environment`] trait and its untyped, object-safe form [`DynEnvironment`].
//!
//! An environment is written once against typed actions, observations and state
//! (serde + schemars); the server hosts it through [`DynEnvironment`], which speaks raw
//! JSON, tracks `episode_id`/`step_count` for the OpenEnv state contract, answers the
//! step-path MCP actions, and turns deserialization failures into pydantic-shaped
//! validation issues.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use agentstack_protocol::http::{EnvironmentMetadata, ResetRequest};
use agentstack_protocol::mcp::{
    CallToolObservation, CallToolResult, ListToolsObservation, McpStepAction, StepTool, ToolError,
    ToolErrorType, ToolSpec,
};
use agentstack_protocol::validation::{LocPart, ValidationIssue};
use agentstack_protocol::ws::StepResult;
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::tasks::TaskSource;

/// A boxed future, as [`DynEnvironment`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What `reset` receives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResetArgs {
    /// Seed for a reproducible episode. Environments must be deterministic given it.
    pub seed: Option<u64>,
    /// The episode's id: the caller's, or a fresh UUID chosen by the host.
    pub episode_id: String,
    /// Every other reset key the client sent (e.g. `difficulty`).
    pub options: Map<String, Value>,
}

/// What `reset` and `step` return: an observation, a reward and whether the episode
/// is over.
#[derive(Debug, Clone, PartialEq)]
pub struct Step<O> {
    /// The observation.
    pub observation: O,
    /// The reward of the last action, `None` when there is none (e.g. at reset).
    pub reward: Option<f64>,
    /// Whether the episode has ended.
    pub done: bool,
    /// Extra information for the client; sent only when non-empty.
    pub metadata: Map<String, Value>,
}

impl<O> Step<O> {
    /// An observation with no reward, not done, no metadata.
    pub fn new(observation: O) -> Self {
        Self {
            observation,
            reward: None,
            done: false,
            metadata: Map::new(),
        }
    }

    /// The same step with `reward`.
    pub fn with_reward(mut self, reward: f64) -> Self {
        self.reward = Some(reward);
        self
    }

    /// The same step, ending the episode when `done`.
    pub fn with_done(mut self, done: bool) -> Self {
        self.done = done;
        self
    }

    /// The same step with one more metadata entry.
    pub fn with_metadata(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.metadata.insert(key.to_owned(), value.into());
        self
    }
}

/// Descriptive facts about an environment.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvInfo {
    /// Short name, e.g. `echo`.
    pub name: String,
    /// One line: what an agent does here.
    pub description: String,
    /// Version of the environment (not of agentstack).
    pub version: String,
    /// Longer documentation, Markdown.
    pub readme: Option<String>,
    /// Author.
    pub author: Option<String>,
    /// Where to read more.
    pub documentation_url: Option<String>,
    /// The lowest and highest reward a step can give; `validate` checks rewards
    /// against it.
    pub reward_range: (f64, f64),
}

impl EnvInfo {
    /// Facts with a name and description, version `1.0.0`, reward range `[0, 1]`.
    pub fn new(name: &str, description: &str) -> Self {
        Self {
            name: name.to_owned(),
            description: description.to_owned(),
            version: "1.0.0".to_owned(),
            readme: None,
            author: None,
            documentation_url: None,
            reward_range: (0.0, 1.0),
        }
    }

    /// The `/metadata` body.
    pub fn metadata(&self) -> EnvironmentMetadata {
        EnvironmentMetadata {
            name: self.name.clone(),
            description: self.description.clone(),
            readme_content: self.readme.clone(),
            version: Some(self.version.clone()),
            author: self.author.clone(),
            documentation_url: self.documentation_url.clone(),
        }
    }
}

/// A failure of the environment itself while handling a message. Sent to the client
/// as `EXECUTION_ERROR`; the session stays up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct EnvError {
    /// What went wrong, for the client.
    pub message: String,
}

impl EnvError {
    /// An error with `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// Why a tool call failed at the framework level (not an error the tool reports in
/// its own result).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolCallError {
    /// No tool has this name.
    #[error("Unknown tool: '{0}'")]
    NotFound(String),
    /// The arguments do not fit the tool.
    #[error("Invalid arguments: {0}")]
    InvalidArgs(String),
    /// The tool failed.
    #[error("{0}")]
    Execution(String),
}

impl ToolCallError {
    fn kind(&self) -> ToolErrorType {
        match self {
            ToolCallError::NotFound(_) => ToolErrorType::ToolNotFound,
            ToolCallError::InvalidArgs(_) => ToolErrorType::InvalidArgs,
            ToolCallError::Execution(_) => ToolErrorType::ExecutionError,
        }
    }
}

/// An environment with typed actions, observations and state.
///
/// Each session gets its own instance, made by the factory given to
/// [`crate::EnvSpec::new`]. The host tracks `episode_id` and `step_count`; `state()`
/// returns only the environment's own extra fields.
///
/// ```
/// use agentstack_env::{EnvError, EnvInfo, Environment, ResetArgs, Step};
/// use schemars::JsonSchema;
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Deserialize, JsonSchema)]
/// #[serde(deny_unknown_fields)]
/// struct Guess { number: i64 }
///
/// #[derive(Serialize, JsonSchema)]
/// struct Hint { hint: String }
///
/// #[derive(Serialize, JsonSchema)]
/// struct NoState {}
///
/// struct HighLow { target: i64 }
///
/// impl Environment for HighLow {
///     type Action = Guess;
///     type Observation = Hint;
///     type State = NoState;
///
///     fn info(&self) -> EnvInfo { EnvInfo::new("high_low", "Guess a number from hints") }
///
///     async fn reset(&mut self, args: ResetArgs) -> Result<Step<Hint>, EnvError> {
///         self.target = (args.seed.unwrap_or(0) % 100) as i64;
///         Ok(Step::new(Hint { hint: "guess 0..99".into() }))
///     }
///
///     async fn step(&mut self, guess: Guess) -> Result<Step<Hint>, EnvError> {
///         let hint = match guess.number.cmp(&self.target) {
///             std::cmp::Ordering::Less => "higher",
///             std::cmp::Ordering::Greater => "lower",
///             std::cmp::Ordering::Equal => "correct",
///         };
///         let won = hint == "correct";
///         Ok(Step::new(Hint { hint: hint.into() }).with_reward(if won { 1.0 } else { 0.0 }).with_done(won))
///     }
///
///     fn state(&self) -> NoState { NoState {} }
/// }
/// ```
pub trait Environment: Send + 'static {
    /// What the agent sends each step. Use `#[serde(deny_unknown_fields)]` to reject
    /// extra keys as the reference does.
    type Action: DeserializeOwned + JsonSchema + Send;
    /// What the agent sees after each step.
    type Observation: Serialize + JsonSchema + Send;
    /// Extra state fields beside `episode_id` and `step_count`.
    type State: Serialize + JsonSchema;

    /// Name, description, version, reward range.
    fn info(&self) -> EnvInfo;

    /// Starts a new episode.
    fn reset(
        &mut self,
        args: ResetArgs,
    ) -> impl Future<Output = Result<Step<Self::Observation>, EnvError>> + Send;

    /// Applies one action.
    fn step(
        &mut self,
        action: Self::Action,
    ) -> impl Future<Output = Result<Step<Self::Observation>, EnvError>> + Send;

    /// The environment's own state fields.
    fn state(&self) -> Self::State;

    /// MCP tools this environment offers; none by default.
    fn tools(&self) -> Vec<ToolSpec> {
        Vec::new()
    }

    /// Calls one tool and returns its value.
    fn call_tool(
        &mut self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> impl Future<Output = Result<Value, ToolCallError>> + Send {
        let _ = arguments;
        let name = name.to_owned();
        async move { Err(ToolCallError::NotFound(name)) }
    }

    /// The environment's tasks, if it has a task list (served by the Task API).
    fn task_source(&self) -> Option<Arc<dyn TaskSource>> {
        None
    }
}

/// Why a step could not be applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    /// The action does not fit the action schema; sent as `VALIDATION_ERROR`.
    #[error("invalid action")]
    Invalid(Vec<ValidationIssue>),
    /// The environment failed; sent as `EXECUTION_ERROR`.
    #[error(transparent)]
    Env(#[from] EnvError),
}

/// The wire form of a step: observation already serialized.
pub type StepJson = StepResult<Box<RawValue>>;

/// An environment behind JSON, as the server hosts it. Implemented for every
/// [`Environment`] by [`Hosted`]; implement it directly only for environments that
/// are JSON-native (e.g. proxies).
pub trait DynEnvironment: Send {
    /// Starts a new episode.
    fn reset(&mut self, request: ResetRequest) -> BoxFuture<'_, Result<StepJson, EnvError>>;
    /// Applies one action given as a JSON object.
    fn step<'a>(&'a mut self, action: &'a RawValue) -> BoxFuture<'a, Result<StepJson, StepError>>;
    /// The state: `episode_id`, `step_count` and the environment's fields.
    fn state(&self) -> Result<Map<String, Value>, EnvError>;
    /// The MCP tools, empty when the environment has none.
    fn tools(&self) -> Vec<ToolSpec>;
    /// Calls a tool through JSON-RPC `tools/call`.
    fn call_tool<'a>(
        &'a mut self,
        name: &'a str,
        arguments: Map<String, Value>,
    ) -> BoxFuture<'a, Result<CallToolResult, ToolCallError>>;
}

/// The host-side wrapper that makes any [`Environment`] a [`DynEnvironment`].
pub struct Hosted<E> {
    env: E,
    episode_id: Option<String>,
    step_count: u64,
    has_tools: bool,
}

impl<E: Environment> Hosted<E> {
    /// Wraps `env`.
    pub fn new(env: E) -> Self {
        let has_tools = !env.tools().is_empty();
        Self {
            env,
            episode_id: None,
            step_count: 0,
            has_tools,
        }
    }

    /// The wrapped environment.
    pub fn inner(&self) -> &E {
        &self.env
    }
}

/// The wire observation: the environment's fields plus `metadata`, as the reference
/// nests it.
#[derive(Serialize)]
struct WireObservation<'a, O> {
    #[serde(flatten)]
    observation: &'a O,
    metadata: &'a Map<String, Value>,
}

/// Serializes a typed step into its wire form.
pub fn step_to_json<O: Serialize>(step: Step<O>) -> Result<StepJson, EnvError> {
    let raw = serde_json::value::to_raw_value(&WireObservation {
        observation: &step.observation,
        metadata: &step.metadata,
    })
    .map_err(|e| EnvError::new(format!("observation could not be serialized: {e}")))?;
    Ok(StepResult {
        observation: raw,
        reward: step.reward,
        done: step.done,
        metadata: (!step.metadata.is_empty()).then_some(step.metadata),
    })
}

/// Deserializes `raw` as `T`, reporting failures as pydantic-shaped issues with the
/// path of the offending field.
pub fn deserialize_with_issues<T: DeserializeOwned>(raw: &str) -> Result<T, Vec<ValidationIssue>> {
    let mut de = serde_json::Deserializer::from_str(raw);
    serde_path_to_error::deserialize::<_, T>(&mut de).map_err(|err| {
        let loc: Vec<LocPart> = err
            .path()
            .iter()
            .filter_map(|seg| match seg {
                serde_path_to_error::Segment::Map { key } => Some(LocPart::Key(key.clone())),
                serde_path_to_error::Segment::Seq { index } => Some(LocPart::Index(*index)),
                serde_path_to_error::Segment::Enum { variant } => {
                    Some(LocPart::Key(variant.clone()))
                }
                serde_path_to_error::Segment::Unknown => None,
            })
            .collect();
        let msg = err.inner().to_string();
        // serde_json appends " at line L column C"; people want the first part.
        let msg = msg.split(" at line ").next().unwrap_or(&msg).to_owned();
        let kind = if msg.starts_with("unknown field") {
            "extra_forbidden"
        } else if msg.starts_with("missing field") {
            "missing"
        } else if msg.starts_with("invalid type") {
            "type_error"
        } else {
            "value_error"
        };
        vec![ValidationIssue::new(kind, loc, msg)]
    })
}

fn is_only_unknown_metadata(issues: &[ValidationIssue]) -> bool {
    issues.len() == 1 && issues[0].kind == "extra_forbidden" && issues[0].msg.contains("`metadata`")
}

impl<E: Environment> Hosted<E> {
    fn parse_action(&self, raw: &RawValue) -> Result<E::Action, Vec<ValidationIssue>> {
        match deserialize_with_issues::<E::Action>(raw.get()) {
            Ok(action) => Ok(action),
            // OpenEnv's `Action` base has a `metadata` field every action accepts; allow
            // it without making every environment declare it.
            Err(issues) if is_only_unknown_metadata(&issues) => {
                let mut object: Map<String, Value> =
                    serde_json::from_str(raw.get()).map_err(|_| issues.clone())?;
                match object.remove("metadata") {
                    Some(Value::Object(_)) => {}
                    _ => return Err(issues),
                }
                let text = Value::Object(object).to_string();
                deserialize_with_issues::<E::Action>(&text)
            }
            Err(issues) => Err(issues),
        }
    }

    async fn mcp_step(&mut self, action: McpStepAction) -> Result<StepJson, StepError> {
        match action {
            McpStepAction::ListTools { .. } => step_to_json(Step::new(ListToolsObservation {
                tools: self.env.tools().into_iter().map(StepTool::from).collect(),
                metadata: Map::new(),
            }))
            .map_err(StepError::Env),
            McpStepAction::CallTool {
                tool_name,
                arguments,
                ..
            } => {
                self.step_count += 1;
                let observation = match self.env.call_tool(&tool_name, arguments).await {
                    Ok(value) => CallToolObservation {
                        tool_name,
                        result: Some(CallToolResult::ok(value)),
                        error: None,
                        metadata: Map::new(),
                    },
                    Err(err) => CallToolObservation {
                        tool_name,
                        result: None,
                        error: Some(ToolError {
                            error_type: err.kind(),
                            message: err.to_string(),
                        }),
                        metadata: Map::new(),
                    },
                };
                step_to_json(Step::new(observation)).map_err(StepError::Env)
            }
        }
    }
}

impl<E: Environment> DynEnvironment for Hosted<E> {
    fn reset(&mut self, request: ResetRequest) -> BoxFuture<'_, Result<StepJson, EnvError>> {
        Box::pin(async move {
            let episode_id = request
                .episode_id
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            let args = ResetArgs {
                seed: request.seed,
                episode_id: episode_id.clone(),
                options: request.options,
            };
            let step = self.env.reset(args).await?;
            self.episode_id = Some(episode_id);
            self.step_count = 0;
            step_to_json(step)
        })
    }

    fn step<'a>(&'a mut self, action: &'a RawValue) -> BoxFuture<'a, Result<StepJson, StepError>> {
        Box::pin(async move {
            if self.has_tools
                && let Ok(mcp) = serde_json::from_str::<McpStepAction>(action.get())
            {
                return self.mcp_step(mcp).await;
            }
            let typed = self.parse_action(action).map_err(StepError::Invalid)?;
            let step = self.env.step(typed).await?;
            self.step_count += 1;
            Ok(step_to_json(step)?)
        })
    }

    fn state(&self) -> Result<Map<String, Value>, EnvError> {
        let mut map = Map::new();
        map.insert(
            "episode_id".into(),
            self.episode_id.clone().map_or(Value::Null, Value::String),
        );
        map.insert("step_count".into(), self.step_count.into());
        match serde_json::to_value(self.env.state()) {
            Ok(Value::Object(extra)) => {
                for (k, v) in extra {
                    if k != "episode_id" && k != "step_count" {
                        map.insert(k, v);
                    }
                }
                Ok(map)
            }
            Ok(Value::Null) => Ok(map),
            Ok(other) => Err(EnvError::new(format!(
                "state must serialize to an object, got {other}"
            ))),
            Err(e) => Err(EnvError::new(format!("state could not be serialized: {e}"))),
        }
    }

    fn tools(&self) -> Vec<ToolSpec> {
        self.env.tools()
    }

    fn call_tool<'a>(
        &'a mut self,
        name: &'a str,
        arguments: Map<String, Value>,
    ) -> BoxFuture<'a, Result<CallToolResult, ToolCallError>> {
        Box::pin(async move {
            self.step_count += 1;
            self.env
                .call_tool(name, arguments)
                .await
                .map(CallToolResult::ok)
        })
    }
}
