//! The task set: function tasks (JSONL) and repository tasks (directories), built in or
//! loaded from a directory in the same layout (`tasks/coding/README.md`).

use std::collections::BTreeMap;
use std::path::Path;

use agentstack_env::{TaskError, TaskSource};
use agentstack_protocol::tasks::{Split, SplitType};
use include_dir::{Dir, include_dir};
use serde::Deserialize;
use serde_json::{Value, json};

/// The built-in task set, compiled in.
static BUILTIN: Dir<'static> = include_dir!("$CARGO_MANIFEST_DIR/tasks/coding");

/// Lowest and highest difficulty.
pub const DIFFICULTIES: std::ops::RangeInclusive<u8> = 1..=5;

/// The largest file a task may ship.
const MAX_TASK_FILE_BYTES: usize = 1 << 20;

/// A function task: write `solution.py`; tests are Python snippets.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionTask {
    /// Unique id.
    pub id: String,
    /// 1 (trivial) to 5 (hard).
    pub difficulty: u8,
    /// What the agent sees.
    pub prompt: String,
    /// The name the tests call.
    pub entry_point: String,
    /// Tests shown to the agent.
    pub visible_tests: Vec<String>,
    /// Tests that decide the reward.
    pub hidden_tests: Vec<String>,
    /// A correct `solution.py`.
    pub reference: String,
}

/// A repository task: fix a snapshot so its tests (and hidden ones) pass.
#[derive(Debug, Clone, PartialEq)]
pub struct RepoTask {
    /// Unique id.
    pub id: String,
    /// 1 to 5.
    pub difficulty: u8,
    /// The issue the agent works on.
    pub prompt: String,
    /// The snapshot: path → contents.
    pub repo: BTreeMap<String, String>,
    /// Test files laid over the snapshot for grading.
    pub hidden: BTreeMap<String, String>,
    /// Files that fix the snapshot.
    pub solution: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RepoTaskHeader {
    id: String,
    difficulty: u8,
    prompt: String,
}

/// Either kind of task.
#[derive(Debug, Clone, PartialEq)]
pub enum Task {
    /// Write a function.
    Function(FunctionTask),
    /// Fix a repository.
    Repo(RepoTask),
}

impl Task {
    /// The task's id.
    pub fn id(&self) -> &str {
        match self {
            Self::Function(t) => &t.id,
            Self::Repo(t) => &t.id,
        }
    }

    /// Its difficulty.
    pub fn difficulty(&self) -> u8 {
        match self {
            Self::Function(t) => t.difficulty,
            Self::Repo(t) => t.difficulty,
        }
    }

    /// `function` or `repo`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Function(_) => "function",
            Self::Repo(_) => "repo",
        }
    }
}

/// A loaded, checked task set.
#[derive(Debug, Clone, Default)]
pub struct TaskSet {
    tasks: Vec<Task>,
}

impl TaskSet {
    /// The built-in tasks.
    pub fn builtin() -> Self {
        Self::from_files(&builtin_files()).expect("the built-in task set is valid (tested)")
    }

    /// Loads a task set from a directory in the documented layout.
    pub fn load(dir: &Path) -> Result<Self, String> {
        let mut files = BTreeMap::new();
        read_tree(dir, dir, &mut files)?;
        if files.is_empty() {
            return Err(format!(
                "{} holds no tasks (expected functions.jsonl or repos/<id>/)",
                dir.display()
            ));
        }
        Self::from_files(&files)
    }

    /// Builds a task set from its files (path relative to the set's root → contents).
    fn from_files(files: &BTreeMap<String, String>) -> Result<Self, String> {
        let mut tasks = Vec::new();
        if let Some(jsonl) = files.get("functions.jsonl") {
            for (n, line) in jsonl.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let task: FunctionTask = serde_json::from_str(line)
                    .map_err(|e| format!("functions.jsonl line {}: {e}", n + 1))?;
                check_function(&task)
                    .map_err(|e| format!("functions.jsonl line {} ({}): {e}", n + 1, task.id))?;
                tasks.push(Task::Function(task));
            }
        }
        let mut repos: BTreeMap<&str, Vec<(&str, &str)>> = BTreeMap::new();
        for (path, contents) in files {
            if let Some(rest) = path.strip_prefix("repos/")
                && let Some((id, inner)) = rest.split_once('/')
            {
                repos.entry(id).or_default().push((inner, contents));
            }
        }
        for (dir, entries) in repos {
            let task = repo_task(dir, &entries).map_err(|e| format!("repos/{dir}: {e}"))?;
            tasks.push(Task::Repo(task));
        }
        let mut seen = std::collections::BTreeSet::new();
        for task in &tasks {
            if !seen.insert(task.id().to_owned()) {
                return Err(format!("task id {:?} is used twice", task.id()));
            }
        }
        Ok(Self { tasks })
    }

    /// Every task, function tasks first, in file order.
    pub fn tasks(&self) -> &[Task] {
        &self.tasks
    }

    /// The task called `id`.
    pub fn get(&self, id: &str) -> Option<&Task> {
        self.tasks.iter().find(|t| t.id() == id)
    }
}

fn builtin_files() -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    collect_builtin(&BUILTIN, &mut files);
    files
}

fn collect_builtin(dir: &Dir<'static>, out: &mut BTreeMap<String, String>) {
    for file in dir.files() {
        if let Some(text) = file.contents_utf8() {
            out.insert(file.path().to_string_lossy().into_owned(), text.to_owned());
        }
    }
    for sub in dir.dirs() {
        collect_builtin(sub, out);
    }
}

fn read_tree(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("reading {}: {e}", dir.display()))?;
        let path = entry.path();
        let meta =
            std::fs::symlink_metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if meta.is_dir() {
            read_tree(root, &path, out)?;
        } else if meta.is_file() {
            if meta.len() as usize > MAX_TASK_FILE_BYTES {
                return Err(format!(
                    "{} is larger than {MAX_TASK_FILE_BYTES} bytes",
                    path.display()
                ));
            }
            let relative = path
                .strip_prefix(root)
                .ok()
                .and_then(|p| p.to_str())
                .ok_or_else(|| format!("{} has a path that is not UTF-8", path.display()))?;
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            out.insert(relative.to_owned(), text);
        }
    }
    Ok(())
}

fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty()
        || !id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(format!("id {id:?} must match [a-z0-9_]+"));
    }
    Ok(())
}

fn check_difficulty(difficulty: u8) -> Result<(), String> {
    if !DIFFICULTIES.contains(&difficulty) {
        return Err(format!("difficulty {difficulty} must be from 1 to 5"));
    }
    Ok(())
}

fn check_function(task: &FunctionTask) -> Result<(), String> {
    check_id(&task.id)?;
    check_difficulty(task.difficulty)?;
    if task.prompt.trim().is_empty() {
        return Err("prompt is empty".into());
    }
    if task.entry_point.trim().is_empty() {
        return Err("entry_point is empty".into());
    }
    if task.hidden_tests.is_empty() {
        return Err("hidden_tests is empty: the reward needs at least one".into());
    }
    if task.reference.trim().is_empty() {
        return Err("reference is empty".into());
    }
    Ok(())
}

fn repo_task(dir: &str, entries: &[(&str, &str)]) -> Result<RepoTask, String> {
    let header = entries
        .iter()
        .find(|(path, _)| *path == "task.json")
        .ok_or("task.json is missing")?;
    let header: RepoTaskHeader =
        serde_json::from_str(header.1).map_err(|e| format!("task.json: {e}"))?;
    check_id(&header.id)?;
    check_difficulty(header.difficulty)?;
    if header.id != dir {
        return Err(format!(
            "task.json says id {:?} but the directory is {dir:?}",
            header.id
        ));
    }
    let mut task = RepoTask {
        id: header.id,
        difficulty: header.difficulty,
        prompt: header.prompt,
        repo: BTreeMap::new(),
        hidden: BTreeMap::new(),
        solution: BTreeMap::new(),
    };
    for (path, contents) in entries {
        let (part, inner) = match path.split_once('/') {
            Some(split) => split,
            None if *path == "task.json" => continue,
            None => {
                return Err(format!(
                    "unexpected file {path:?}: files go under repo/, hidden/ or solution/"
                ));
            }
        };
        agentstack_sandbox::job::check_relative_path(inner)?;
        let target = match part {
            "repo" => &mut task.repo,
            "hidden" => &mut task.hidden,
            "solution" => &mut task.solution,
            other => {
                return Err(format!(
                    "unexpected directory {other:?}: use repo/, hidden/ or solution/"
                ));
            }
        };
        target.insert(inner.to_owned(), (*contents).to_owned());
    }
    if !task.repo.keys().any(|p| p.starts_with("tests/")) {
        return Err("repo/tests/ has no tests".into());
    }
    Ok(task)
}

/// The Task API view: one split, `test`, listing every task as its reset options.
#[derive(Debug, Clone)]
pub struct CodingTasks {
    ids: Vec<String>,
}

impl CodingTasks {
    /// The task list of `set`.
    pub fn new(set: &TaskSet) -> Self {
        Self {
            ids: set.tasks().iter().map(|t| t.id().to_owned()).collect(),
        }
    }
}

impl TaskSource for CodingTasks {
    fn splits(&self) -> Vec<Split> {
        vec![Split {
            name: "test".to_owned(),
            kind: SplitType::Test,
        }]
    }

    fn num_tasks(&self, split: &str) -> Result<usize, TaskError> {
        match split {
            "test" => Ok(self.ids.len()),
            other => Err(self.unknown_split(other)),
        }
    }

    fn task(&self, split: &str, index: usize) -> Result<Value, TaskError> {
        self.num_tasks(split)?;
        let id = self.ids.get(index).ok_or(TaskError::InvalidIndex)?;
        Ok(json!({"task": id}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_set_has_graded_function_tasks_and_repositories() {
        let set = TaskSet::builtin();
        let functions: Vec<_> = set
            .tasks()
            .iter()
            .filter_map(|t| match t {
                Task::Function(f) => Some(f),
                Task::Repo(_) => None,
            })
            .collect();
        assert!(functions.len() >= 50);
        for level in DIFFICULTIES {
            assert!(functions.iter().filter(|t| t.difficulty == level).count() >= 10);
        }
        let repos = set.tasks().iter().filter(|t| t.kind() == "repo").count();
        assert!(repos >= 3);
        assert!(matches!(set.get("count_vowels"), Some(Task::Function(_))));
    }

    #[test]
    fn bad_task_sets_say_where() {
        let mut files = BTreeMap::new();
        files.insert(
            "functions.jsonl".to_owned(),
            "{\"id\": \"Bad Id\", \"difficulty\": 1, \"prompt\": \"p\", \"entry_point\": \"f\", \"visible_tests\": [], \"hidden_tests\": [\"assert 1\"], \"reference\": \"x=1\"}\n".to_owned(),
        );
        let err = TaskSet::from_files(&files).unwrap_err();
        assert!(err.contains("line 1") && err.contains("[a-z0-9_]"), "{err}");
        let mut files = BTreeMap::new();
        files.insert("repos/x/repo/a.py".to_owned(), String::new());
        let err = TaskSet::from_files(&files).unwrap_err();
        assert!(
            err.contains("repos/x") && err.contains("task.json"),
            "{err}"
        );
        files.insert(
            "repos/x/task.json".to_owned(),
            "{\"id\": \"x\", \"difficulty\": 2, \"prompt\": \"p\"}".to_owned(),
        );
        files.insert("repos/x/repo/../escape".to_owned(), String::new());
        assert!(TaskSet::from_files(&files).unwrap_err().contains(".."));
    }
}
