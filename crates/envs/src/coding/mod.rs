//! `coding`: write code that passes hidden tests, run in a sandbox.
//!
//! Two kinds of task (see `tasks/coding/README.md` for the format):
//!
//! - **function** tasks: a specification and visible examples; the agent writes
//!   `solution.py`; the reward is the fraction of hidden tests that pass;
//! - **repository** tasks (SWE-smith style): a small repository with failing tests and
//!   an issue; the agent reads and edits files; the reward is the fraction of the test
//!   suite (its own tests as shipped plus hidden ones) that passes.
//!
//! Actions are JSON objects `{"tool": .., ...}`, and the same operations are MCP tools:
//! `write_file`, `read_file`, `list_files`, `run_tests` (the visible tests; no reward)
//! and `submit` (the hidden tests; the reward; the episode ends). The shortest episode
//! is one action, `{"code": "..."}`: write `solution.py` and submit.
//!
//! Every test run happens in `agentstack-sandbox`; the environment refuses to start
//! when this machine cannot isolate.

mod grader;
pub mod tasks;

use std::collections::BTreeMap;
use std::sync::Arc;

use agentstack_env::{
    EnvError, EnvInfo, EnvSpec, Environment, ResetArgs, Step, TaskSource, ToolCallError,
};
use agentstack_protocol::mcp::ToolSpec;
use agentstack_sandbox::{Sandbox, SandboxConfig};
use rand::seq::IndexedRandom;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::sync::OnceCell;

pub use grader::{TEST_TIMEOUT, TestResult, TestRun};
pub use tasks::{CodingTasks, FunctionTask, RepoTask, Task, TaskSet};

use crate::episode::{EPISODE_OVER, NO_EPISODE, episode_rng, int_option};

/// The name the environment is served under.
pub const NAME: &str = "coding";

/// Names a directory of tasks (the documented layout) served instead of the built-in
/// set.
pub const TASKS_ENV: &str = agentstack_static::env_vars::AGENTSTACK_CODING_TASKS;

/// The file function tasks are written in.
pub const SOLUTION_FILE: &str = "solution.py";

/// The most files an agent may create.
const MAX_FILES: usize = 200;
/// The largest file an agent may write.
const MAX_FILE_BYTES: usize = 256 << 10;
/// The most steps an episode may be given.
const MAX_STEPS_LIMIT: u64 = 200;

const README: &str = r#"# coding

Write code that passes hidden tests. Every test run happens in a sandbox (no network,
read-only system, limits on time, memory, processes and output).

## Tasks

- **function** (60 built in, difficulty 1–5): a specification and visible examples;
  write `solution.py`.
- **repo** (4 built in): a small Python repository with failing tests and an issue
  to fix; read and edit its files.

Reset options: `task` (an id; see the Task API, split `test`), or `kind`
(`function`, `repo` or `any`, default `function`) and `difficulty` (1–5) to draw one
with the seed; `max_steps` (default 1 for function tasks, 30 for repositories).

## Action

```json
{"code": "def f(x):\n    return x"}
{"tool": "run_tests", "code": "..."}
{"tool": "write_file", "path": "pkg/mod.py", "content": "..."}
{"tool": "read_file", "path": "pkg/mod.py"}
{"tool": "list_files"}
{"tool": "submit"}
```

`tool` defaults to `submit`; `code` (with `submit` or `run_tests`) replaces
`solution.py` first. The same tools are offered over MCP.

## Observation

`prompt` (the task, at reset), `files` (the workspace), `output` (test results, file
contents or errors), `tests_passed`/`tests_total` (the visible tests, after
`run_tests`), `steps_left`.

## Reward

0 until `submit` (or the last allowed step, which submits); then the fraction of
hidden tests that pass (function tasks) or of the whole test suite (repositories).
"#;

/// What the agent does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CodingTool {
    /// Grade the workspace against the hidden tests and end the episode.
    #[default]
    Submit,
    /// Run the visible tests.
    RunTests,
    /// Create or replace a file.
    WriteFile,
    /// Read a file.
    ReadFile,
    /// List the workspace's files.
    ListFiles,
}

/// The coding environment's action.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CodingAction {
    /// What to do; `submit` when omitted.
    #[serde(default)]
    pub tool: CodingTool,
    /// With `submit` or `run_tests`: the new contents of `solution.py`, written first.
    #[serde(default)]
    pub code: Option<String>,
    /// With `write_file` and `read_file`: the file's path in the workspace.
    #[serde(default)]
    pub path: Option<String>,
    /// With `write_file`: the file's new contents.
    #[serde(default)]
    pub content: Option<String>,
}

/// What the agent sees.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct CodingObservation {
    /// The task (at reset; empty afterwards).
    pub prompt: String,
    /// The workspace's files.
    pub files: Vec<String>,
    /// What the last action produced: test results, a file's contents, or an error.
    pub output: String,
    /// Visible tests that passed in the last `run_tests`.
    pub tests_passed: Option<usize>,
    /// Visible tests run in the last `run_tests`.
    pub tests_total: Option<usize>,
    /// Steps left before the workspace is submitted.
    pub steps_left: u64,
}

/// The environment's own state fields.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct CodingState {
    /// The task's id, once reset.
    pub task: Option<String>,
    /// `function` or `repo`.
    pub kind: Option<String>,
    /// The task's difficulty.
    pub difficulty: Option<u8>,
    /// The seed the task was drawn with.
    pub seed: Option<u64>,
    /// Hidden tests passed at submission.
    pub hidden_passed: Option<usize>,
    /// Hidden tests at submission.
    pub hidden_total: Option<usize>,
}

/// The sandbox, started on first use and shared by every session of one spec.
struct SharedSandbox {
    config: SandboxConfig,
    cell: OnceCell<Result<Sandbox, String>>,
}

impl SharedSandbox {
    async fn get(&self) -> Result<&Sandbox, EnvError> {
        let started = self
            .cell
            .get_or_init(|| async {
                Sandbox::start(self.config.clone())
                    .await
                    .map_err(|e| e.to_string())
            })
            .await;
        started
            .as_ref()
            .map_err(|e| EnvError::new(format!("the coding environment needs a sandbox: {e}")))
    }
}

struct Episode {
    task: Arc<Task>,
    seed: u64,
    files: BTreeMap<String, String>,
    max_steps: u64,
    steps: u64,
    done: bool,
    hidden: Option<(usize, usize)>,
    marker: String,
}

/// The coding environment.
pub struct CodingEnv {
    tasks: Arc<Vec<Arc<Task>>>,
    source: Arc<CodingTasks>,
    sandbox: Arc<SharedSandbox>,
    episode: Option<Episode>,
}

/// The spec that serves the coding environment: the built-in tasks, or those in
/// `AGENTSTACK_CODING_TASKS`.
pub fn spec() -> EnvSpec {
    let set = match std::env::var_os(TASKS_ENV) {
        Some(dir) if !dir.is_empty() => match TaskSet::load(std::path::Path::new(&dir)) {
            Ok(set) => set,
            Err(e) => {
                tracing::error!("{TASKS_ENV}: {e}; serving the built-in tasks instead");
                TaskSet::builtin()
            }
        },
        _ => TaskSet::builtin(),
    };
    spec_with(set, default_sandbox())
}

/// The sandbox configuration the coding environment uses by default: a small warm
/// pool and one run per core at once.
pub fn default_sandbox() -> SandboxConfig {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    SandboxConfig {
        warm: 2,
        max_concurrent: workers,
        ..SandboxConfig::default()
    }
}

/// A spec serving `set`, running tests in sandboxes made with `sandbox`.
pub fn spec_with(set: TaskSet, sandbox: SandboxConfig) -> EnvSpec {
    let source = Arc::new(CodingTasks::new(&set));
    let tasks: Arc<Vec<Arc<Task>>> = Arc::new(set.tasks().iter().cloned().map(Arc::new).collect());
    let sandbox = Arc::new(SharedSandbox {
        config: sandbox,
        cell: OnceCell::new(),
    });
    EnvSpec::new(move || CodingEnv {
        tasks: Arc::clone(&tasks),
        source: Arc::clone(&source),
        sandbox: Arc::clone(&sandbox),
        episode: None,
    })
}

impl CodingEnv {
    fn pick(&self, args: &ResetArgs) -> Result<(Arc<Task>, u64), EnvError> {
        let (seed, mut rng) = episode_rng(args.seed);
        if let Some(id) = args.options.get("task") {
            let id = id.as_str().ok_or_else(|| {
                EnvError::new(format!(
                    "invalid reset option `task`: expected a task id string, got {id}"
                ))
            })?;
            let task = self.tasks.iter().find(|t| t.id() == id).ok_or_else(|| {
                EnvError::new(format!(
                    "unknown task {id:?}; list them with the Task API (split `test`)"
                ))
            })?;
            return Ok((Arc::clone(task), seed));
        }
        let kind = match args.options.get("kind") {
            None | Some(Value::Null) => "function",
            Some(Value::String(kind)) if ["function", "repo", "any"].contains(&kind.as_str()) => {
                kind.as_str()
            }
            Some(other) => {
                return Err(EnvError::new(format!(
                    "invalid reset option `kind`: expected \"function\", \"repo\" or \"any\", got {other}"
                )));
            }
        };
        let difficulty = match args.options.get("difficulty") {
            None | Some(Value::Null) => None,
            Some(_) => Some(int_option(&args.options, "difficulty", 1, 1..=5)? as u8),
        };
        let candidates: Vec<&Arc<Task>> = self
            .tasks
            .iter()
            .filter(|t| kind == "any" || t.kind() == kind)
            .filter(|t| difficulty.is_none_or(|d| t.difficulty() == d))
            .collect();
        let task = candidates.choose(&mut rng).ok_or_else(|| {
            EnvError::new(format!(
                "no {kind} task has difficulty {}",
                difficulty.unwrap_or(0)
            ))
        })?;
        Ok((Arc::clone(task), seed))
    }

    fn observation(
        episode: &Episode,
        prompt: String,
        output: String,
        tests: Option<(usize, usize)>,
    ) -> CodingObservation {
        CodingObservation {
            prompt,
            files: episode
                .files
                .keys()
                .filter(|p| !p.starts_with('.'))
                .cloned()
                .collect(),
            output,
            tests_passed: tests.map(|t| t.0),
            tests_total: tests.map(|t| t.1),
            steps_left: episode.max_steps.saturating_sub(episode.steps),
        }
    }

    fn write(episode: &mut Episode, path: &str, content: String) -> Result<(), String> {
        agentstack_sandbox::job::check_relative_path(path)?;
        if path.starts_with("_agentstack") {
            return Err(format!(
                "{path:?}: names starting with _agentstack are reserved"
            ));
        }
        if content.len() > MAX_FILE_BYTES {
            return Err(format!(
                "{path:?} is {} bytes; files may be at most {MAX_FILE_BYTES}",
                content.len()
            ));
        }
        if !episode.files.contains_key(path) && episode.files.len() >= MAX_FILES {
            return Err(format!("the workspace already has {MAX_FILES} files"));
        }
        episode.files.insert(path.to_owned(), content);
        Ok(())
    }

    /// The visible tests (`hidden` false) or the ones that decide the reward. For
    /// repositories the latter are the shipped `tests/` (agent edits there are
    /// dropped) plus the hidden files.
    async fn tests(&self, episode: &Episode, hidden: bool) -> Result<TestRun, EnvError> {
        let sandbox = self.sandbox.get().await?;
        let graded;
        let (files, suite) = match episode.task.as_ref() {
            Task::Function(task) => {
                let tests = if hidden {
                    &task.hidden_tests
                } else {
                    &task.visible_tests
                };
                (&episode.files, grader::Suite::Snippets(tests))
            }
            Task::Repo(_) if !hidden => (&episode.files, grader::Suite::Unittest),
            Task::Repo(task) => {
                let shipped_tests = task.repo.iter().filter(|(p, _)| p.starts_with("tests/"));
                graded = episode
                    .files
                    .iter()
                    .filter(|(path, _)| !path.starts_with("tests/"))
                    .chain(shipped_tests)
                    .chain(&task.hidden)
                    .map(|(p, c)| (p.clone(), c.clone()))
                    .collect::<BTreeMap<_, _>>();
                (&graded, grader::Suite::Unittest)
            }
        };
        grader::run_tests(sandbox, files, suite, &episode.marker)
            .await
            .map_err(|e| EnvError::new(format!("running the tests failed: {e}")))
    }

    /// Applies one action. `Err` is a failure of the environment; a mistake of the
    /// agent's (a missing argument, an unknown file) is the returned problem, also
    /// shown in the observation, and the episode goes on.
    async fn apply(
        &mut self,
        action: CodingAction,
    ) -> Result<(Step<CodingObservation>, Option<String>), EnvError> {
        let mut episode = self
            .episode
            .take()
            .ok_or_else(|| EnvError::new(NO_EPISODE))?;
        let result = self.apply_to(&mut episode, action).await;
        self.episode = Some(episode);
        result
    }

    async fn apply_to(
        &self,
        episode: &mut Episode,
        action: CodingAction,
    ) -> Result<(Step<CodingObservation>, Option<String>), EnvError> {
        if episode.done {
            return Err(EnvError::new(EPISODE_OVER));
        }
        episode.steps += 1;
        let last_step = episode.steps >= episode.max_steps;
        let mut output = String::new();
        let mut tests = None;
        let mut problem = match (action.code.clone(), action.tool) {
            (None, _) => None,
            (Some(code), CodingTool::Submit | CodingTool::RunTests) => {
                Self::write(episode, SOLUTION_FILE, code).err()
            }
            (Some(_), _) => Some(
                "`code` goes with `submit` or `run_tests`; use `content` with write_file".into(),
            ),
        };
        if problem.is_none() {
            match action.tool {
                CodingTool::Submit => {}
                CodingTool::RunTests => {
                    let run = self.tests(episode, false).await?;
                    let sources = match episode.task.as_ref() {
                        Task::Function(task) => Some(task.visible_tests.as_slice()),
                        Task::Repo(_) => None,
                    };
                    tests = Some((run.passed(), run.tests.len()));
                    output = grader::describe(&run, sources);
                }
                CodingTool::WriteFile => match (&action.path, action.content.clone()) {
                    (Some(path), Some(content)) => match Self::write(episode, path, content) {
                        Ok(()) => output = format!("wrote {path}"),
                        Err(e) => problem = Some(e),
                    },
                    _ => problem = Some("write_file needs `path` and `content`".into()),
                },
                CodingTool::ReadFile => match &action.path {
                    Some(path) => match episode.files.get(path) {
                        Some(contents) => output = contents.clone(),
                        None => {
                            problem =
                                Some(format!("no file {path:?}; list_files shows what exists"))
                        }
                    },
                    None => problem = Some("read_file needs `path`".into()),
                },
                CodingTool::ListFiles => {
                    output = episode.files.keys().cloned().collect::<Vec<_>>().join("\n");
                }
            }
        }
        if let Some(problem) = &problem {
            output = format!("error: {problem}");
        }
        if action.tool == CodingTool::Submit || last_step {
            let run = self.tests(episode, true).await?;
            let total = run.tests.len();
            let passed = run.passed();
            let reward = if total == 0 {
                0.0
            } else {
                passed as f64 / total as f64
            };
            episode.done = true;
            episode.hidden = Some((passed, total));
            if !output.is_empty() {
                output.push('\n');
            }
            output.push_str(&format!("submitted: {passed}/{total} hidden tests passed"));
            if let Some(error) = &run.error {
                output.push_str(&format!("\nerror: {error}"));
            }
            let observation = Self::observation(episode, String::new(), output, tests);
            let step = Step::new(observation)
                .with_reward(reward)
                .with_done(true)
                .with_metadata("hidden_passed", passed)
                .with_metadata("hidden_total", total);
            return Ok((step, problem));
        }
        let step =
            Step::new(Self::observation(episode, String::new(), output, tests)).with_reward(0.0);
        Ok((step, problem))
    }
}

impl Environment for CodingEnv {
    type Action = CodingAction;
    type Observation = CodingObservation;
    type State = CodingState;

    fn info(&self) -> EnvInfo {
        EnvInfo {
            readme: Some(README.to_owned()),
            ..EnvInfo::new(
                NAME,
                "Write code that passes hidden tests, run in a sandbox",
            )
        }
    }

    async fn reset(&mut self, args: ResetArgs) -> Result<Step<CodingObservation>, EnvError> {
        let (task, seed) = self.pick(&args)?;
        let default_steps = match task.as_ref() {
            Task::Function(_) => 1,
            Task::Repo(_) => 30,
        };
        let max_steps = int_option(
            &args.options,
            "max_steps",
            default_steps,
            1..=MAX_STEPS_LIMIT,
        )?;
        // Fail now, not mid-episode, when this machine cannot isolate.
        self.sandbox.get().await?;
        let (files, prompt) = match task.as_ref() {
            Task::Function(t) => {
                let examples = t
                    .visible_tests
                    .iter()
                    .map(|s| format!("    {s}"))
                    .collect::<Vec<_>>()
                    .join("\n");
                (
                    BTreeMap::new(),
                    format!("{}\n\nVisible tests:\n\n{examples}\n", t.prompt.trim_end()),
                )
            }
            Task::Repo(t) => (
                t.repo.clone(),
                format!(
                    "{}\n\nThe repository's files are listed in `files`; read them with read_file, edit with write_file, run the tests with run_tests, and submit when done.\n",
                    t.prompt.trim_end()
                ),
            ),
        };
        let marker = format!(
            "@@agentstack-result-{:016x}{:016x}@@",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let episode = Episode {
            task,
            seed,
            files,
            max_steps,
            steps: 0,
            done: false,
            hidden: None,
            marker,
        };
        let observation = Self::observation(&episode, prompt, String::new(), None);
        self.episode = Some(episode);
        Ok(Step::new(observation).with_reward(0.0))
    }

    async fn step(&mut self, action: CodingAction) -> Result<Step<CodingObservation>, EnvError> {
        self.apply(action).await.map(|(step, _)| step)
    }

    fn state(&self) -> CodingState {
        let episode = self.episode.as_ref();
        CodingState {
            task: episode.map(|e| e.task.id().to_owned()),
            kind: episode.map(|e| e.task.kind().to_owned()),
            difficulty: episode.map(|e| e.task.difficulty()),
            seed: episode.map(|e| e.seed),
            hidden_passed: episode.and_then(|e| e.hidden.map(|h| h.0)),
            hidden_total: episode.and_then(|e| e.hidden.map(|h| h.1)),
        }
    }

    fn tools(&self) -> Vec<ToolSpec> {
        let path = json!({"type": "string", "description": "Path relative to the workspace root"});
        let schema = |properties: Value, required: &[&str]| json!({"type": "object", "properties": properties, "required": required});
        vec![
            ToolSpec {
                name: "write_file".into(),
                description: "Create or replace a file in the workspace.".into(),
                input_schema: schema(
                    json!({"path": path, "content": {"type": "string", "description": "The file's new contents"}}),
                    &["path", "content"],
                ),
            },
            ToolSpec {
                name: "read_file".into(),
                description: "Read a file of the workspace.".into(),
                input_schema: schema(json!({"path": path}), &["path"]),
            },
            ToolSpec {
                name: "list_files".into(),
                description: "List the workspace's files.".into(),
                input_schema: schema(json!({}), &[]),
            },
            ToolSpec {
                name: "run_tests".into(),
                description: "Run the visible tests on the workspace; returns their results."
                    .into(),
                input_schema: schema(json!({}), &[]),
            },
            ToolSpec {
                name: "submit".into(),
                description: "Grade the workspace against the hidden tests and end the episode."
                    .into(),
                input_schema: schema(json!({}), &[]),
            },
        ]
    }

    async fn call_tool(
        &mut self,
        name: &str,
        arguments: Map<String, Value>,
    ) -> Result<Value, ToolCallError> {
        let text = |key: &str| -> Result<String, ToolCallError> {
            arguments
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| {
                    ToolCallError::InvalidArgs(format!("`{key}` (a string) is required"))
                })
        };
        let action = match name {
            "write_file" => CodingAction {
                tool: CodingTool::WriteFile,
                path: Some(text("path")?),
                content: Some(text("content")?),
                code: None,
            },
            "read_file" => CodingAction {
                tool: CodingTool::ReadFile,
                path: Some(text("path")?),
                ..CodingAction::default()
            },
            "list_files" => CodingAction {
                tool: CodingTool::ListFiles,
                ..CodingAction::default()
            },
            "run_tests" => CodingAction {
                tool: CodingTool::RunTests,
                ..CodingAction::default()
            },
            "submit" => CodingAction::default(),
            other => return Err(ToolCallError::NotFound(other.to_owned())),
        };
        let (step, problem) = self
            .apply(action)
            .await
            .map_err(|e| ToolCallError::Execution(e.to_string()))?;
        if let Some(problem) = problem {
            return Err(ToolCallError::Execution(problem));
        }
        let observation = step.observation;
        Ok(json!({
            "output": observation.output,
            "tests_passed": observation.tests_passed,
            "tests_total": observation.tests_total,
            "reward": step.reward,
            "done": step.done,
        }))
    }

    fn task_source(&self) -> Option<Arc<dyn TaskSource>> {
        Some(Arc::clone(&self.source) as Arc<dyn TaskSource>)
    }
}
