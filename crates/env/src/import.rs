//! `env import`: a [verifiers] environment (a Python module or package with
//! `load_environment`) wrapped as an OpenEnv package that `env serve` and
//! `env validate` take like any other.
//!
//! The package runs the environment's own rollout with the OpenEnv agent in the seat
//! of the model (see `templates/verifiers/server/bridge.py.tmpl`): `reset` picks an
//! example and shows its prompt, `step` hands the agent's reply to the rollout, which
//! answers with `env_response` until it stops; the reward is the rubric's weighted
//! score.
//!
//! Importing checks the source without running it ([`plan`]), stages the package,
//! loads the environment once in the given Python to learn its rubric and examples
//! ([`Probe`]), then writes `openenv.yaml`, `README.md` and `requirements.txt` and
//! moves the package into place; a failure at any point leaves nothing behind.
//!
//! ```no_run
//! # async fn demo() -> Result<(), agentstack_env::import::ImportError> {
//! use agentstack_env::import::{self, ImportRequest};
//!
//! let request = ImportRequest::new("environments/my_env".into());
//! let imported = import::import(&request, "venv/bin/python").await?;
//! println!("{}: {} examples", imported.dir.display(), imported.probe.examples);
//! # Ok(()) }
//! ```
//!
//! [verifiers]: https://github.com/PrimeIntellect-ai/verifiers

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentstack_static::{env_vars, packaging};
use serde::Deserialize;
use serde_json::{Map, Value};

/// The `openenv` version the package's server is written against.
pub const OPENENV_VERSION: &str = "0.10.0";

/// How long loading the environment to learn its shape may take: importing
/// verifiers, openenv and datasets alone takes seconds on a busy machine.
pub const DEFAULT_PROBE_LIMIT: Duration = Duration::from_secs(300);

/// The most bytes copied from a source directory.
pub const MAX_SOURCE_BYTES: u64 = 64 << 20;

/// The most files copied from a source directory.
pub const MAX_SOURCE_FILES: usize = 5_000;

/// Module names the copied source may not take: the package's own `server`, and the
/// libraries the server imports, which a module of the same name would shadow.
const RESERVED_MODULES: &[&str] = &["server", "source", "verifiers", "openenv", "datasets"];

/// Printed by the probe before its JSON line.
const PROBE_MARKER: &str = "AGENTSTACK_PROBE ";

/// Why a verifiers environment could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The source path does not exist.
    #[error(
        "{0} does not exist\nhint: give a verifiers environment: a .py file that defines load_environment, or its directory"
    )]
    Missing(PathBuf),
    /// The source is neither a `.py` file nor a directory.
    #[error(
        "{0} is not a Python file or a directory\nhint: give a verifiers environment: a .py file that defines load_environment, or its directory"
    )]
    NotPython(PathBuf),
    /// Nothing in the source defines `load_environment`.
    #[error(
        "{0} defines no load_environment\nhint: a verifiers environment module has `def load_environment(**kwargs)` returning a vf.Environment"
    )]
    NoLoadEnvironment(PathBuf),
    /// Several modules in a directory define `load_environment`.
    #[error(
        "{dir} has several modules with load_environment: {}\nhint: import one of them by its file, e.g. {}",
        .modules.join(", "),
        .dir.join(&.modules[0]).display()
    )]
    Ambiguous {
        /// The directory.
        dir: PathBuf,
        /// The files, relative to it.
        modules: Vec<String>,
    },
    /// The module's name is not one Python can import under.
    #[error(
        "'{0}' cannot be the environment's module name\nhint: rename the file or directory to letters, digits and '_' (not starting with a digit, and not server, source, verifiers, openenv or datasets)"
    )]
    BadModule(String),
    /// The package name is not a valid environment name.
    #[error(
        "'{0}' is not a valid environment name\nhint: give a name of lowercase letters, digits and '_', starting with a letter"
    )]
    BadName(String),
    /// The output directory exists.
    #[error("{0} already exists\nhint: choose another output directory, or remove this one")]
    Exists(PathBuf),
    /// The source directory is larger than [`MAX_SOURCE_BYTES`] or
    /// [`MAX_SOURCE_FILES`].
    #[error(
        "{path} holds more than {what}, more than an environment's source\nhint: import the module's own file or package directory, or move data out of it"
    )]
    TooLarge {
        /// The directory.
        path: PathBuf,
        /// Which limit, in words.
        what: String,
    },
    /// Reading or writing a file failed.
    #[error("could not {action} {path}")]
    Io {
        /// "read", "write", ...
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The Python interpreter could not be started.
    #[error(
        "could not run {python}\nhint: pass --python (or set AGENTSTACK_PYTHON) to a Python with verifiers and openenv=={OPENENV_VERSION} installed"
    )]
    NoPython {
        /// The interpreter.
        python: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Loading the environment failed.
    #[error(
        "loading the environment with {python} failed:\n{message}\nhint: that Python needs verifiers, openenv=={OPENENV_VERSION} and the environment's own dependencies, and load_environment must succeed with the given arguments"
    )]
    Probe {
        /// The interpreter.
        python: String,
        /// The end of what it printed on stderr.
        message: String,
    },
    /// Loading the environment took longer than the limit.
    #[error("loading the environment with {python} took longer than {limit:?}")]
    ProbeTimeout {
        /// The interpreter.
        python: String,
        /// The limit.
        limit: Duration,
    },
}

/// What to import.
#[derive(Debug, Clone)]
pub struct ImportRequest {
    /// A `.py` file defining `load_environment`, a package directory whose
    /// `__init__.py` exports it, or a project directory holding such a module (the
    /// layout `vf-init` makes).
    pub source: PathBuf,
    /// The package directory to create; default `./<name>`.
    pub out: Option<PathBuf>,
    /// The environment's name; default the module's name.
    pub name: Option<String>,
    /// Keyword arguments for `load_environment`.
    pub args: Map<String, Value>,
    /// How long loading the environment may take.
    pub probe_limit: Duration,
}

impl ImportRequest {
    /// A request with the defaults.
    pub fn new(source: PathBuf) -> Self {
        Self {
            source,
            out: None,
            name: None,
            args: Map::new(),
            probe_limit: DEFAULT_PROBE_LIMIT,
        }
    }
}

/// How the source is laid out, which decides what is copied under `source/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One `.py` file: copied to `source/<module>.py`.
    File,
    /// A package directory with `__init__.py`: copied to `source/<module>/`.
    Package,
    /// A project directory holding the module (and its `pyproject.toml`, README,
    /// data): its contents copied to `source/`.
    Project,
}

/// A checked import, before anything is written.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The source, canonical.
    pub source: PathBuf,
    /// How it is laid out.
    pub layout: Layout,
    /// The module `verifiers.load_environment` imports.
    pub module: String,
    /// The environment's name.
    pub name: String,
    /// The package directory to create.
    pub out: PathBuf,
    /// Keyword arguments for `load_environment`.
    pub args: Map<String, Value>,
}

/// One reward function of the rubric.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RewardFunc {
    /// Its name (also its key in `metrics`).
    pub name: String,
    /// Its weight in the reward; 0 for metrics.
    pub weight: f64,
}

/// What loading the environment showed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Probe {
    /// The environment's class, e.g. `SingleTurnEnv`.
    pub class: String,
    /// `single-turn`, `multi-turn`, `tool`, or the class name for other kinds.
    pub kind: String,
    /// The split episodes are drawn from by default, `train` or `eval`.
    pub split: String,
    /// How many examples it holds.
    pub examples: u64,
    /// The rubric's functions and weights.
    pub reward_funcs: Vec<RewardFunc>,
    /// Names of the tools a reply may call.
    pub tools: Vec<String>,
    /// The verifiers version it was loaded with.
    pub verifiers_version: String,
    /// The copied project's own dependencies (`[project].dependencies`).
    #[serde(default)]
    pub dependencies: Vec<String>,
}

impl Probe {
    /// The range of the rubric's weighted score when every reward function scores in
    /// [0, 1], verifiers' convention; `None` when no function has a nonzero weight.
    pub fn reward_range(&self) -> Option<[f64; 2]> {
        let weights = self.reward_funcs.iter().map(|f| f.weight);
        let low: f64 = weights.clone().map(|w| w.min(0.0)).sum();
        let high: f64 = weights.map(|w| w.max(0.0)).sum();
        (low.is_finite() && high.is_finite() && low < high).then_some([low, high])
    }
}

/// A finished import.
#[derive(Debug, Clone)]
pub struct Imported {
    /// The package directory.
    pub dir: PathBuf,
    /// What was imported.
    pub plan: Plan,
    /// What loading it showed.
    pub probe: Probe,
}

const TEMPLATES: [(&str, &str); 4] = [
    (
        "__init__.py",
        include_str!("../templates/verifiers/__init__.py.tmpl"),
    ),
    (
        "server/__init__.py",
        include_str!("../templates/verifiers/server/__init__.py.tmpl"),
    ),
    (
        "server/app.py",
        include_str!("../templates/verifiers/server/app.py.tmpl"),
    ),
    (
        "server/bridge.py",
        include_str!("../templates/verifiers/server/bridge.py.tmpl"),
    ),
];
const MANIFEST: &str = include_str!("../templates/verifiers/openenv.yaml.tmpl");
const README: &str = include_str!("../templates/verifiers/README.md.tmpl");
const PROBE: &str = include_str!("../templates/verifiers/probe.py");

/// Whether Python source defines or imports `load_environment` at its top level:
/// `def`/`async def`, an assignment, or `from … import … load_environment` (also in
/// parentheses over several lines). A text check, so nothing runs; loading the module
/// later is the real test.
pub fn defines_load_environment(text: &str) -> bool {
    let named = |rest: &str| {
        rest.strip_prefix("load_environment")
            .is_some_and(|r| r.starts_with(['(', ' ', '=', ':']))
    };
    let imports_it = |names: &str| {
        names
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|word| word == "load_environment")
    };
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let line = line.trim_end();
        if line.strip_prefix("def ").is_some_and(named)
            || line.strip_prefix("async def ").is_some_and(named)
            || (named(line) && line.contains('='))
        {
            return true;
        }
        if let Some((_, names)) = line
            .strip_prefix("from ")
            .and_then(|rest| rest.split_once(" import "))
        {
            let mut names = names.to_owned();
            if names.contains('(') {
                for more in lines.by_ref() {
                    names.push_str(more);
                    if more.contains(')') {
                        break;
                    }
                }
            }
            if imports_it(&names) {
                return true;
            }
        }
    }
    false
}

/// A Python module name made from a file or directory name: `-` becomes `_`, as
/// `verifiers.load_environment` does with environment ids.
fn module_name(stem: &str) -> Result<String, ImportError> {
    let module = stem.replace('-', "_");
    let ok = module
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && module
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !RESERVED_MODULES.contains(&module.as_str());
    if ok {
        Ok(module)
    } else {
        Err(ImportError::BadModule(module))
    }
}

fn valid_name(name: &str) -> bool {
    name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn read(path: &Path) -> Result<String, ImportError> {
    std::fs::read_to_string(path).map_err(|source| ImportError::Io {
        action: "read",
        path: path.to_owned(),
        source,
    })
}

fn file_defines(path: &Path) -> Result<bool, ImportError> {
    Ok(path.is_file() && defines_load_environment(&read(path)?))
}

/// Finds the module in a directory: a package (`__init__.py`), else in a project
/// `<dir name>.py` or `<dir name>/__init__.py`, else the one top-level `.py` file
/// that defines `load_environment`.
fn locate_in_dir(dir: &Path) -> Result<(Layout, String), ImportError> {
    let dir_name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let init = dir.join("__init__.py");
    if init.is_file() {
        if !file_defines(&init)? {
            return Err(ImportError::NoLoadEnvironment(init));
        }
        return Ok((Layout::Package, module_name(&dir_name)?));
    }
    let own = dir_name.replace('-', "_");
    if file_defines(&dir.join(format!("{own}.py")))?
        || file_defines(&dir.join(&own).join("__init__.py"))?
    {
        return Ok((Layout::Project, module_name(&own)?));
    }
    let entries = std::fs::read_dir(dir).map_err(|source| ImportError::Io {
        action: "read",
        path: dir.to_owned(),
        source,
    })?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|source| ImportError::Io {
                action: "read",
                path: dir.to_owned(),
                source,
            })?
            .path();
        if path.extension().is_some_and(|e| e == "py") && file_defines(&path)? {
            found.push(
                path.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    found.sort();
    match found.len() {
        0 => Err(ImportError::NoLoadEnvironment(dir.to_owned())),
        1 => {
            let stem = found[0].trim_end_matches(".py");
            Ok((Layout::Project, module_name(stem)?))
        }
        _ => Err(ImportError::Ambiguous {
            dir: dir.to_owned(),
            modules: found,
        }),
    }
}

/// Checks the request without running anything: the source exists and defines
/// `load_environment`, its module and package names are valid, and the output does
/// not exist.
pub fn plan(request: &ImportRequest) -> Result<Plan, ImportError> {
    let given = &request.source;
    if !given.exists() {
        return Err(ImportError::Missing(given.clone()));
    }
    let source = given.canonicalize().map_err(|source| ImportError::Io {
        action: "read",
        path: given.clone(),
        source,
    })?;
    let (layout, module) = if source.is_dir() {
        locate_in_dir(&source)?
    } else if source.extension().is_some_and(|e| e == "py") {
        if !file_defines(&source)? {
            return Err(ImportError::NoLoadEnvironment(given.clone()));
        }
        let stem = source.file_stem().unwrap_or_default().to_string_lossy();
        (Layout::File, module_name(&stem)?)
    } else {
        return Err(ImportError::NotPython(given.clone()));
    };
    let name = request
        .name
        .clone()
        .unwrap_or_else(|| module.to_ascii_lowercase());
    if !valid_name(&name) {
        return Err(ImportError::BadName(name));
    }
    let out = request.out.clone().unwrap_or_else(|| PathBuf::from(&name));
    if out.exists() {
        return Err(ImportError::Exists(out));
    }
    Ok(Plan {
        source,
        layout,
        module,
        name,
        out,
        args: request.args.clone(),
    })
}

/// A directory that is removed when dropped, unless [`Staging::keep`] moved it.
struct Staging(Option<PathBuf>);

impl Staging {
    fn path(&self) -> &Path {
        self.0.as_deref().unwrap_or(Path::new(""))
    }

    fn keep(mut self, to: &Path) -> Result<(), ImportError> {
        let from = self.0.take().unwrap_or_default();
        std::fs::rename(&from, to).map_err(|source| {
            let _ = std::fs::remove_dir_all(&from);
            ImportError::Io {
                action: "create",
                path: to.to_owned(),
                source,
            }
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}

fn write(path: &Path, text: &str) -> Result<(), ImportError> {
    let io = |source| ImportError::Io {
        action: "write",
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    std::fs::write(path, text).map_err(io)
}

/// Copies the regular files under `from` to `to`, skipping what packaging skips
/// ([`packaging::is_skipped`]) and symbolic links, within [`MAX_SOURCE_BYTES`] and
/// [`MAX_SOURCE_FILES`].
fn copy_tree(
    from: &Path,
    to: &Path,
    root: &Path,
    totals: &mut (u64, usize),
) -> Result<(), ImportError> {
    let io = |action, path: &Path| {
        let path = path.to_owned();
        move |source| ImportError::Io {
            action,
            path,
            source,
        }
    };
    std::fs::create_dir_all(to).map_err(io("write", to))?;
    let mut entries: Vec<_> = std::fs::read_dir(from)
        .map_err(io("read", from))?
        .collect::<Result<_, _>>()
        .map_err(io("read", from))?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name();
        if packaging::is_skipped(&name.to_string_lossy()) {
            continue;
        }
        let kind = entry.file_type().map_err(io("read", &path))?;
        if kind.is_dir() {
            copy_tree(&path, &to.join(&name), root, totals)?;
        } else if kind.is_file() {
            let size = entry.metadata().map_err(io("read", &path))?.len();
            totals.0 += size;
            totals.1 += 1;
            if totals.0 > MAX_SOURCE_BYTES {
                return Err(ImportError::TooLarge {
                    path: root.to_owned(),
                    what: format!("{} MiB", MAX_SOURCE_BYTES >> 20),
                });
            }
            if totals.1 > MAX_SOURCE_FILES {
                return Err(ImportError::TooLarge {
                    path: root.to_owned(),
                    what: format!("{MAX_SOURCE_FILES} files"),
                });
            }
            std::fs::copy(&path, to.join(&name)).map_err(io("write", &to.join(&name)))?;
        }
    }
    Ok(())
}

/// Writes the server, its settings and a copy of the source into `dir`.
fn stage(plan: &Plan, dir: &Path) -> Result<(), ImportError> {
    for (rel, template) in TEMPLATES {
        let text = template
            .replace("{{name}}", &plan.name)
            .replace("{{module}}", &plan.module);
        write(&dir.join(rel), &text)?;
    }
    let settings =
        serde_json::json!({ "name": plan.name, "module": plan.module, "args": plan.args });
    write(
        &dir.join("server/verifiers_source.json"),
        &format!("{settings:#}\n"),
    )?;
    let source_dir = dir.join("source");
    let mut totals = (0, 0);
    match plan.layout {
        Layout::File => {
            let to = source_dir.join(format!("{}.py", plan.module));
            write(&to, &read(&plan.source)?)?;
        }
        Layout::Package => {
            copy_tree(
                &plan.source,
                &source_dir.join(&plan.module),
                &plan.source,
                &mut totals,
            )?;
        }
        Layout::Project => copy_tree(&plan.source, &source_dir, &plan.source, &mut totals)?,
    }
    Ok(())
}

/// The last lines of a failed probe's stderr: the end of a Python traceback.
fn tail(stderr: &str, lines: usize) -> String {
    let kept: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = kept.len().saturating_sub(lines);
    kept[start..]
        .iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Loads the environment in the staged package with `python`, as the server will.
async fn probe(dir: &Path, python: &str, limit: Duration) -> Result<Probe, ImportError> {
    let pythonpath = match std::env::var(env_vars::PYTHONPATH) {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
        _ => dir.display().to_string(),
    };
    let child = tokio::process::Command::new(python)
        .arg("-c")
        .arg(PROBE)
        .current_dir(dir)
        .env(env_vars::PYTHONPATH, pythonpath)
        .env(env_vars::PYTHONDONTWRITEBYTECODE, "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ImportError::NoPython {
            python: python.to_owned(),
            source,
        })?;
    let output = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .map_err(|_| ImportError::ProbeTimeout {
            python: python.to_owned(),
            limit,
        })?
        .map_err(|source| ImportError::NoPython {
            python: python.to_owned(),
            source,
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let failed = |message: String| ImportError::Probe {
        python: python.to_owned(),
        message,
    };
    if !output.status.success() {
        return Err(failed(tail(&stderr, 6)));
    }
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(PROBE_MARKER))
        .ok_or_else(|| failed(format!("  it printed no description\n{}", tail(&stderr, 6))))?;
    serde_json::from_str(line).map_err(|e| failed(format!("  its description is not valid: {e}")))
}

fn yaml_range([low, high]: [f64; 2]) -> String {
    format!("[{low:?}, {high:?}]")
}

/// `openenv.yaml`: OpenEnv's keys, and the reward range under ours and under
/// OpenEnv's `validation` (which `env validate` checks rewards against) when known.
pub fn manifest(plan: &Plan, probe: &Probe) -> String {
    let reward = match probe.reward_range() {
        Some(range) => format!(
            "agentstack:\n  reward_range: {r}\nvalidation:\n  reward:\n    range: {r}\n    oracle_tolerance: 0.0\n    floor_margin: 0.1\n  capabilities:\n    verifier:\n      kind: reward_channel\n",
            r = yaml_range(range)
        ),
        None => String::new(),
    };
    MANIFEST
        .replace("{{name}}", &plan.name)
        .replace("{{module}}", &plan.module)
        .replace("{{reward_sections}}\n", &reward)
}

/// `requirements.txt`: verifiers as loaded, openenv, and the source's own
/// dependencies.
pub fn requirements(probe: &Probe) -> String {
    let mut text = format!(
        "verifiers=={}\nopenenv=={OPENENV_VERSION}\n",
        probe.verifiers_version
    );
    for dep in &probe.dependencies {
        let name: String = dep
            .chars()
            .take_while(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | '.'))
            .collect();
        if !name.eq_ignore_ascii_case("verifiers") && !name.eq_ignore_ascii_case("openenv") {
            let _ = writeln!(text, "{dep}");
        }
    }
    text
}

/// `README.md`: where the package came from and how an episode works.
pub fn readme(plan: &Plan, probe: &Probe) -> String {
    let list = |items: Vec<String>| {
        if items.is_empty() {
            "none".to_owned()
        } else {
            items.join(", ")
        }
    };
    let rubric = list(
        probe
            .reward_funcs
            .iter()
            .map(|f| format!("`{}` × {}", f.name, f.weight))
            .collect(),
    );
    let tools = list(probe.tools.iter().map(|t| format!("`{t}`")).collect());
    let range = probe.reward_range().map_or_else(
        || "unknown (not declared in openenv.yaml)".to_owned(),
        yaml_range,
    );
    README
        .replace("{{name}}", &plan.name)
        .replace("{{module}}", &plan.module)
        .replace("{{origin}}", &plan.source.display().to_string())
        .replace("{{args}}", &Value::Object(plan.args.clone()).to_string())
        .replace("{{class}}", &probe.class)
        .replace("{{kind}}", &probe.kind)
        .replace("{{examples}}", &probe.examples.to_string())
        .replace("{{split}}", &probe.split)
        .replace("{{rubric}}", &rubric)
        .replace("{{tools}}", &tools)
        .replace("{{reward_range}}", &range)
        .replace("{{verifiers_version}}", &probe.verifiers_version)
}

/// Imports `request.source` with `python` (which needs verifiers and openenv): plans,
/// stages, loads the environment once, writes the package and moves it into place.
pub async fn import(request: &ImportRequest, python: &str) -> Result<Imported, ImportError> {
    let plan = plan(request)?;
    let parent = match plan.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|source| ImportError::Io {
        action: "create",
        path: parent.clone(),
        source,
    })?;
    let leaf = plan.out.file_name().unwrap_or_default().to_string_lossy();
    let staged = parent.join(format!(".{leaf}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staged);
    let staging = Staging(Some(staged));
    stage(&plan, staging.path())?;
    tracing::info!(%python, module = %plan.module, "loading the environment to learn its rubric and examples");
    let probe = probe(staging.path(), python, request.probe_limit).await?;
    write(
        &staging.path().join("openenv.yaml"),
        &manifest(&plan, &probe),
    )?;
    write(&staging.path().join("README.md"), &readme(&plan, &probe))?;
    write(
        &staging.path().join("requirements.txt"),
        &requirements(&probe),
    )?;
    if plan.out.exists() {
        return Err(ImportError::Exists(plan.out));
    }
    staging.keep(&plan.out)?;
    Ok(Imported {
        dir: plan.out.clone(),
        plan,
        probe,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe_with(weights: &[f64]) -> Probe {
        Probe {
            class: "SingleTurnEnv".into(),
            kind: "single-turn".into(),
            split: "train".into(),
            examples: 3,
            reward_funcs: weights
                .iter()
                .enumerate()
                .map(|(i, &weight)| RewardFunc {
                    name: format!("f{i}"),
                    weight,
                })
                .collect(),
            tools: vec![],
            verifiers_version: "0.3.1".into(),
            dependencies: vec![
                "verifiers>=0.1".into(),
                "math-verify>=0.8".into(),
                "openenv".into(),
            ],
        }
    }

    #[test]
    fn finds_load_environment_without_running_anything() {
        assert!(defines_load_environment(
            "import verifiers as vf\n\ndef load_environment(**kwargs):\n    ..."
        ));
        assert!(defines_load_environment(
            "async def load_environment() -> vf.Environment:"
        ));
        assert!(defines_load_environment(
            "from .my_env import load_environment\n"
        ));
        assert!(defines_load_environment(
            "from .impl import (\n    helper,\n    load_environment,\n)\n"
        ));
        assert!(!defines_load_environment(
            "from .impl import (\n    helper,\n)\nx = load_environment\n"
        ));
        assert!(defines_load_environment("load_environment = make\n"));
        assert!(!defines_load_environment("def load_environments():\n"));
        assert!(!defines_load_environment(
            "# call load_environment() here\n"
        ));
        assert!(!defines_load_environment(
            "class X:\n    def load_environment(self):\n"
        ));
    }

    #[test]
    fn reward_range_is_the_weighted_sum_over_unit_scores() {
        assert_eq!(
            probe_with(&[1.0, 0.5, 0.0]).reward_range(),
            Some([0.0, 1.5])
        );
        assert_eq!(probe_with(&[1.0, -0.25]).reward_range(), Some([-0.25, 1.0]));
        assert_eq!(probe_with(&[0.0]).reward_range(), None);
        assert_eq!(probe_with(&[]).reward_range(), None);
    }

    #[test]
    fn plans_each_layout_and_rejects_bad_sources() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let env = "import verifiers as vf\n\ndef load_environment(**kwargs):\n    pass\n";
        let request = |source: PathBuf| ImportRequest {
            out: Some(root.join("out")),
            ..ImportRequest::new(source)
        };

        std::fs::write(root.join("my-env.py"), env).unwrap();
        let file = plan(&request(root.join("my-env.py"))).unwrap();
        assert_eq!(
            (file.layout, file.module.as_str(), file.name.as_str()),
            (Layout::File, "my_env", "my_env")
        );

        std::fs::create_dir_all(root.join("pkg_env")).unwrap();
        std::fs::write(
            root.join("pkg_env/__init__.py"),
            "from .core import load_environment\n",
        )
        .unwrap();
        let package = plan(&request(root.join("pkg_env"))).unwrap();
        assert_eq!(
            (package.layout, package.module.as_str()),
            (Layout::Package, "pkg_env")
        );

        // vf-init's layout: environments/<id>/<id>.py beside pyproject.toml.
        std::fs::create_dir_all(root.join("proj-env")).unwrap();
        std::fs::write(root.join("proj-env/proj_env.py"), env).unwrap();
        std::fs::write(root.join("proj-env/helpers.py"), "X = 1\n").unwrap();
        let project = plan(&request(root.join("proj-env"))).unwrap();
        assert_eq!(
            (project.layout, project.module.as_str()),
            (Layout::Project, "proj_env")
        );

        std::fs::create_dir_all(root.join("two")).unwrap();
        std::fs::write(root.join("two/a.py"), env).unwrap();
        std::fs::write(root.join("two/b.py"), env).unwrap();
        assert!(matches!(
            plan(&request(root.join("two"))),
            Err(ImportError::Ambiguous { modules, .. }) if modules == ["a.py", "b.py"]
        ));

        std::fs::write(root.join("plain.py"), "X = 1\n").unwrap();
        assert!(matches!(
            plan(&request(root.join("plain.py"))),
            Err(ImportError::NoLoadEnvironment(_))
        ));
        assert!(matches!(
            plan(&request(root.join("nope.py"))),
            Err(ImportError::Missing(_))
        ));
        std::fs::write(root.join("data.json"), "{}").unwrap();
        assert!(matches!(
            plan(&request(root.join("data.json"))),
            Err(ImportError::NotPython(_))
        ));
        std::fs::write(root.join("server.py"), env).unwrap();
        assert!(matches!(
            plan(&request(root.join("server.py"))),
            Err(ImportError::BadModule(_))
        ));
        assert!(matches!(
            plan(&ImportRequest {
                name: Some("Bad-Name".into()),
                ..request(root.join("my-env.py"))
            }),
            Err(ImportError::BadName(_))
        ));
        std::fs::create_dir_all(root.join("out")).unwrap();
        assert!(matches!(
            plan(&request(root.join("my-env.py"))),
            Err(ImportError::Exists(_))
        ));
    }

    #[test]
    fn stages_the_server_and_a_copy_of_the_source() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("proj/__pycache__")).unwrap();
        std::fs::write(
            root.join("proj/proj.py"),
            "def load_environment(**kwargs):\n    pass\n",
        )
        .unwrap();
        std::fs::write(root.join("proj/pyproject.toml"), "[project]\n").unwrap();
        std::fs::write(root.join("proj/__pycache__/proj.pyc"), "junk").unwrap();
        // The hub's skips too (the copies of the list had drifted): stray bytecode and
        // Finder litter.
        std::fs::write(root.join("proj/old.pyc"), "junk").unwrap();
        std::fs::write(root.join("proj/.DS_Store"), "junk").unwrap();
        let mut request = ImportRequest::new(root.join("proj"));
        request.out = Some(root.join("out"));
        request.args.insert("n".into(), 3.into());
        let plan = plan(&request).unwrap();
        let dir = root.join("staged");
        stage(&plan, &dir).unwrap();
        assert!(dir.join("source/proj.py").is_file());
        assert!(dir.join("source/pyproject.toml").is_file());
        assert!(!dir.join("source/__pycache__").exists());
        assert!(!dir.join("source/old.pyc").exists());
        assert!(!dir.join("source/.DS_Store").exists());
        let app = std::fs::read_to_string(dir.join("server/app.py")).unwrap();
        assert!(app.contains("env_name=\"proj\"") && !app.contains("{{"));
        let settings: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("server/verifiers_source.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            settings,
            serde_json::json!({"name": "proj", "module": "proj", "args": {"n": 3}})
        );

        let probe = probe_with(&[1.0, 0.5]);
        let yaml: Value = serde_norway::from_str(&manifest(&plan, &probe)).unwrap();
        assert_eq!(yaml["name"], "proj");
        assert_eq!(yaml["app"], "server.app:app");
        assert_eq!(
            yaml["agentstack"]["reward_range"],
            serde_json::json!([0.0, 1.5])
        );
        assert_eq!(
            yaml["validation"]["reward"]["range"],
            serde_json::json!([0.0, 1.5])
        );
        let unknown: Value = serde_norway::from_str(&manifest(&plan, &probe_with(&[0.0]))).unwrap();
        assert!(unknown.get("agentstack").is_none() && unknown.get("validation").is_none());
        assert_eq!(
            requirements(&probe),
            "verifiers==0.3.1\nopenenv==0.10.0\nmath-verify>=0.8\n"
        );
        let readme = readme(&plan, &probe);
        assert!(readme.contains(&plan.source.display().to_string()));
        assert!(readme.contains("`f1` × 0.5") && !readme.contains("{{"));
    }
}
