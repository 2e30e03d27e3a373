//! The environment side of the loop: a built-in environment hosted in process, or
//! any OpenEnv server reached over its WebSocket protocol (ours, the OpenEnv Python
//! servers, a foreign package started by the caller).

use std::sync::Arc;
use std::time::Duration;

use agentstack_env::client::{ClientConfig, ClientError, EnvClient, HttpClient};
use agentstack_env::{DynEnvironment, EnvSpec, StepError, TaskSource};
use agentstack_protocol::http::{ResetRequest, SchemaResponse};
use agentstack_protocol::mcp::StepTool;
use agentstack_protocol::ws::{ErrorCode, StepResult};
use serde_json::{Map, Value};

/// Why the environment side failed (not the agent's fault; the episode is lost).
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// The environment could not be reached or broke the protocol.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The environment failed while handling a call.
    #[error("the environment failed: {0}")]
    Failed(String),
}

/// Where an environment runs.
#[derive(Clone)]
enum Target {
    Local(Box<EnvSpec>),
    Remote(String),
}

/// An environment the harness can open sessions on: its name, schemas, tools and
/// description, read once.
#[derive(Clone)]
pub struct EnvHandle {
    target: Target,
    name: String,
    description: String,
    schema: SchemaResponse,
    tools: Vec<StepTool>,
    tasks: Option<Arc<dyn TaskSource>>,
    client: ClientConfig,
}

impl std::fmt::Debug for EnvHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvHandle")
            .field("name", &self.name)
            .field("remote", &self.url())
            .finish_non_exhaustive()
    }
}

impl EnvHandle {
    /// A built-in (or any in-process) environment.
    pub fn local(spec: EnvSpec) -> Result<Self, EnvError> {
        let probe = spec.instantiate().map_err(EnvError::Failed)?;
        let tools = probe.tools().into_iter().map(StepTool::from).collect();
        Ok(Self {
            name: spec.name().to_owned(),
            description: spec.info().description.clone(),
            schema: spec.schema().clone(),
            tools,
            tasks: spec.tasks().cloned(),
            target: Target::Local(Box::new(spec)),
            client: ClientConfig::default(),
        })
    }

    /// An OpenEnv server at `url` (`http://host:port`); reads `/metadata`, `/schema`,
    /// the MCP tool list and the task list, when the server has the Task API. Every
    /// request and session bears `client`'s API key, when it has one.
    pub async fn remote(url: &str, client: ClientConfig) -> Result<Self, EnvError> {
        let http = HttpClient::from_config(url, &client)?;
        let metadata = http.metadata().await?;
        let schema = http.schema().await?;
        let tasks = http
            .task_list(&metadata.name)
            .await?
            .map(|list| Arc::new(list) as Arc<dyn TaskSource>);
        let mut probe = EnvClient::connect(url, client.clone()).await?;
        let tools = list_tools(&mut probe).await.unwrap_or_default();
        let _ = probe.close().await;
        Ok(Self {
            name: metadata.name.clone(),
            description: metadata.description.clone(),
            schema,
            tools,
            tasks,
            target: Target::Remote(url.trim_end_matches('/').to_owned()),
            client,
        })
    }

    /// The environment's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What it is, in a sentence.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Its action and observation schemas.
    pub fn schema(&self) -> &SchemaResponse {
        &self.schema
    }

    /// Its MCP tools (empty when it has none).
    pub fn tools(&self) -> &[StepTool] {
        &self.tools
    }

    /// Its task list, when it publishes one (in process, or through a server's Task
    /// API).
    pub fn tasks(&self) -> Option<&Arc<dyn TaskSource>> {
        self.tasks.as_ref()
    }

    /// The server's URL, when it runs elsewhere.
    pub fn url(&self) -> Option<&str> {
        match &self.target {
            Target::Local(_) => None,
            Target::Remote(url) => Some(url),
        }
    }

    /// Opens a new session.
    pub async fn open(&self) -> Result<EnvSession, EnvError> {
        Ok(match &self.target {
            Target::Local(spec) => EnvSession::Local(spec.instantiate().map_err(EnvError::Failed)?),
            Target::Remote(url) => EnvSession::Remote(Box::new(
                EnvClient::connect(url, self.client.clone()).await?,
            )),
        })
    }
}

/// MCP `tools/list` through a session.
async fn list_tools(client: &mut EnvClient) -> Result<Vec<StepTool>, EnvError> {
    let reply = client.mcp("tools/list", Map::new()).await?;
    let Ok(result) = reply.outcome else {
        return Ok(Vec::new());
    };
    let tools = result
        .get("tools")
        .cloned()
        .unwrap_or(Value::Array(Vec::new()));
    serde_json::from_value(tools)
        .map_err(|e| EnvError::Failed(format!("bad tools/list reply: {e}")))
}

/// What a step did.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// The action was applied.
    Applied(StepResult),
    /// The environment rejected the action (it does not fit the action schema); the
    /// message says why, for the model.
    Rejected(String),
}

/// One open episode session.
pub enum EnvSession {
    /// Hosted in this process.
    Local(Box<dyn DynEnvironment>),
    /// Over the OpenEnv WebSocket protocol.
    Remote(Box<EnvClient>),
}

impl EnvSession {
    /// Starts an episode.
    pub async fn reset(&mut self, request: ResetRequest) -> Result<StepResult, EnvError> {
        match self {
            Self::Local(env) => {
                let step = env
                    .reset(request)
                    .await
                    .map_err(|e| EnvError::Failed(e.to_string()))?;
                to_map(step)
            }
            Self::Remote(client) => Ok(client.reset(request).await?),
        }
    }

    /// Applies one action.
    pub async fn step(&mut self, action: &Value) -> Result<StepOutcome, EnvError> {
        match self {
            Self::Local(env) => {
                let raw = serde_json::value::to_raw_value(action)
                    .map_err(|e| EnvError::Failed(e.to_string()))?;
                match env.step(&raw).await {
                    Ok(step) => Ok(StepOutcome::Applied(to_map(step)?)),
                    Err(StepError::Invalid(issues)) => Ok(StepOutcome::Rejected(
                        issues
                            .iter()
                            .map(|i| i.msg.clone())
                            .collect::<Vec<_>>()
                            .join("; "),
                    )),
                    Err(StepError::Env(e)) => Ok(StepOutcome::Rejected(e.to_string())),
                }
            }
            Self::Remote(client) => match client.step(action).await {
                Ok(step) => Ok(StepOutcome::Applied(step)),
                Err(ClientError::Server(error))
                    if matches!(
                        error.code,
                        ErrorCode::ValidationError | ErrorCode::ExecutionError
                    ) =>
                {
                    let details: Vec<String> = error.errors.iter().map(|i| i.msg.clone()).collect();
                    Ok(StepOutcome::Rejected(if details.is_empty() {
                        error.message
                    } else {
                        details.join("; ")
                    }))
                }
                Err(e) => Err(e.into()),
            },
        }
    }

    /// Calls an MCP tool outside the step path; the text of its result, or the
    /// tool's error message.
    pub async fn call_tool(
        &mut self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<Result<String, String>, EnvError> {
        match self {
            Self::Local(env) => Ok(match env.call_tool(name, arguments).await {
                Ok(result) => {
                    let text = tool_text(&serde_json::to_value(&result).unwrap_or_default());
                    if result.is_error { Err(text) } else { Ok(text) }
                }
                Err(e) => Err(e.to_string()),
            }),
            Self::Remote(client) => {
                let mut params = Map::new();
                params.insert("name".into(), Value::String(name.to_owned()));
                params.insert("arguments".into(), Value::Object(arguments));
                let reply = client.mcp("tools/call", params).await?;
                Ok(match reply.outcome {
                    Ok(result) => {
                        let text = tool_text(&result);
                        if result.get("isError").and_then(Value::as_bool) == Some(true) {
                            Err(text)
                        } else {
                            Ok(text)
                        }
                    }
                    Err(error) => Err(error.message),
                })
            }
        }
    }

    /// Ends the session.
    pub async fn close(self) {
        if let Self::Remote(client) = self {
            let _ = tokio::time::timeout(Duration::from_secs(5), client.close()).await;
        }
    }
}

fn to_map(step: agentstack_env::StepJson) -> Result<StepResult, EnvError> {
    let observation: Map<String, Value> = serde_json::from_str(step.observation.get())
        .map_err(|e| EnvError::Failed(format!("observation is not a JSON object: {e}")))?;
    Ok(StepResult {
        observation,
        reward: step.reward,
        done: step.done,
        metadata: step.metadata,
    })
}

/// The text blocks of an MCP tool result, else its data as JSON.
fn tool_text(result: &Value) -> String {
    let texts: Vec<&str> = result
        .get("content")
        .and_then(Value::as_array)
        .map(|blocks| {
            blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default();
    if texts.is_empty() {
        result
            .get("structuredContent")
            .or_else(|| result.get("data"))
            .map(Value::to_string)
            .unwrap_or_default()
    } else {
        texts.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use agentstack_env::client::ApiKey;
    use agentstack_env::server::{Server, ServerConfig};

    use super::*;

    /// Regression: `eval --env URL` and `train` could not open an environment served
    /// with API keys. The key in the client settings goes with the handle's reads
    /// (`/metadata`, `/schema`, the Task API, the tool probe) and with every session;
    /// without it, opening fails with the client's 401.
    #[tokio::test]
    async fn a_remote_environment_with_keys_opens_with_the_key() {
        let key = ApiKey::new("harness-key").unwrap();
        let server = Server::bind(
            ServerConfig {
                api_keys: vec![key.clone()],
                ..ServerConfig::default()
            },
            vec![agentstack_envs::find("echo").unwrap()],
        )
        .await
        .unwrap();
        let url = server.url();
        let handle = server.handle();
        tokio::spawn(server.serve());

        let refused = EnvHandle::remote(&url, ClientConfig::default()).await;
        assert!(
            matches!(
                refused,
                Err(EnvError::Client(ClientError::Unauthorized {
                    key_sent: false,
                    ..
                }))
            ),
            "{refused:?}"
        );
        let client = ClientConfig {
            api_key: Some(key),
            ..ClientConfig::default()
        };
        let env = EnvHandle::remote(&url, client).await.unwrap();
        assert_eq!(env.name(), "echo");
        let mut session = env.open().await.unwrap();
        session.reset(ResetRequest::default()).await.unwrap();
        let outcome = session
            .step(&serde_json::json!({"message": "hi"}))
            .await
            .unwrap();
        assert!(matches!(outcome, StepOutcome::Applied(_)), "{outcome:?}");
        session.close().await;
        handle.shutdown();
    }
}
