//! [`EnvSpec`]: everything the server needs to host one kind of environment.

use std::fmt;
use std::sync::Arc;

use agentstack_protocol::http::SchemaResponse;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::environment::{DynEnvironment, EnvInfo, Environment, Hosted};
use crate::tasks::TaskSource;

type Factory = dyn Fn() -> Result<Box<dyn DynEnvironment>, String> + Send + Sync;

/// A named environment kind: a factory for sessions plus its metadata and schemas,
/// computed once.
#[derive(Clone)]
pub struct EnvSpec {
    name: String,
    info: EnvInfo,
    schema: SchemaResponse,
    factory: Arc<Factory>,
    tasks: Option<Arc<dyn TaskSource>>,
}

impl fmt::Debug for EnvSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnvSpec").field("name", &self.name).finish()
    }
}

/// The observation schema as the reference publishes it: the environment's fields
/// plus the base `done`, `reward` and `metadata`.
#[derive(Serialize, JsonSchema)]
struct ObservationSchema<O> {
    #[serde(flatten)]
    observation: O,
    /// Whether the episode has terminated.
    done: bool,
    /// Reward signal from the last action.
    reward: Option<f64>,
    /// Additional metadata for the observation.
    metadata: Map<String, Value>,
}

/// The state schema: `episode_id` and `step_count` plus the environment's fields.
#[derive(Serialize, JsonSchema)]
struct StateSchema<S> {
    /// Unique identifier for the current episode.
    episode_id: Option<String>,
    /// Number of steps taken in the current episode.
    step_count: u64,
    #[serde(flatten)]
    extra: S,
}

fn schema_of<T: JsonSchema>() -> Value {
    serde_json::to_value(schemars::schema_for!(T)).expect("schemas serialize")
}

impl EnvSpec {
    /// A spec for environments made by `factory`. The factory is called once now to
    /// read metadata, schemas and the task list.
    pub fn new<E, F>(factory: F) -> Self
    where
        E: Environment,
        F: Fn() -> E + Send + Sync + 'static,
    {
        let prototype = factory();
        let info = prototype.info();
        let tasks = prototype.task_source();
        Self {
            name: info.name.clone(),
            info,
            schema: SchemaResponse {
                action: schema_of::<E::Action>(),
                observation: schema_of::<ObservationSchema<E::Observation>>(),
                state: schema_of::<StateSchema<E::State>>(),
                reset_observation: None,
            },
            factory: Arc::new(move || {
                Ok(Box::new(Hosted::new(factory())) as Box<dyn DynEnvironment>)
            }),
            tasks,
        }
    }

    /// A spec from parts, for JSON-native environments.
    pub fn from_parts(
        info: EnvInfo,
        schema: SchemaResponse,
        factory: impl Fn() -> Result<Box<dyn DynEnvironment>, String> + Send + Sync + 'static,
        tasks: Option<Arc<dyn TaskSource>>,
    ) -> Self {
        Self {
            name: info.name.clone(),
            info,
            schema,
            factory: Arc::new(factory),
            tasks,
        }
    }

    /// The same spec under another name (to serve one kind twice).
    pub fn renamed(mut self, name: &str) -> Self {
        name.clone_into(&mut self.name);
        self
    }

    /// The name it is served under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its metadata.
    pub fn info(&self) -> &EnvInfo {
        &self.info
    }

    /// Its JSON Schemas.
    pub fn schema(&self) -> &SchemaResponse {
        &self.schema
    }

    /// Its task list, if any.
    pub fn tasks(&self) -> Option<&Arc<dyn TaskSource>> {
        self.tasks.as_ref()
    }

    /// Makes a new instance for a session.
    pub fn instantiate(&self) -> Result<Box<dyn DynEnvironment>, String> {
        (self.factory)()
    }
}
