//! Running tests in the sandbox and reading their results.
//!
//! One sandbox run per test run: the workspace's files, a grader script and a JSON
//! list of what to run. The grader reads a random marker from stdin before it imports
//! any of the agent's code, and prints its results after that marker, so output the
//! agent's code prints cannot pass for results. (Code that runs in the same Python
//! process could still dig the marker out of the grader's frames: as with every
//! in-process Python grader, rewards are only as trustworthy as that; the sandbox
//! keeps the host safe either way.)

use std::collections::BTreeMap;
use std::time::Duration;

use agentstack_sandbox::{End, Job, JobFile, Limits, Sandbox};
use serde::Deserialize;
use serde_json::json;

/// How long one test may run.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(2);

const GRADER_FILE: &str = "_agentstack_grader.py";
const SPEC_FILE: &str = "_agentstack_tests.json";

/// The grader, run as `python3 _agentstack_grader.py _agentstack_tests.json`.
const GRADER: &str = r#"
import io, json, os, signal, sys, traceback

def short_error(exc, source=None):
    if isinstance(exc, AssertionError) and not str(exc):
        return "AssertionError" + (": " + source.strip().splitlines()[0] if source else "")
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-600:]

class Timeout(BaseException):
    pass

def on_alarm(signum, frame):
    raise Timeout()

def limited(timeout, fn):
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)

def run_functions(spec, captured):
    results = []
    try:
        module = __import__(spec["module"])
        names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        base = {name: getattr(module, name) for name in names if hasattr(module, name)}
    except BaseException as exc:
        error = "importing solution.py failed: " + short_error(exc)
        return {"error": error, "tests": [{"passed": False, "error": error} for _ in spec["tests"]]}
    for source in spec["tests"]:
        namespace = dict(base)
        try:
            limited(spec["timeout"], lambda: exec(compile(source, "<test>", "exec"), namespace))
            results.append({"passed": True})
        except Timeout:
            results.append({"passed": False, "error": "timed out after %gs" % spec["timeout"]})
        except BaseException as exc:
            results.append({"passed": False, "error": short_error(exc, source)})
    return {"tests": results}

def run_unittest(spec, captured):
    import unittest
    sys.path.insert(0, os.getcwd())
    results = []
    class Result(unittest.TestResult):
        def startTest(self, test):
            super().startTest(test)
            signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, spec["timeout"])
        def stopTest(self, test):
            signal.setitimer(signal.ITIMER_REAL, 0)
            super().stopTest(test)
        def addSuccess(self, test):
            results.append({"name": test.id(), "passed": True})
        def addFailure(self, test, err):
            results.append({"name": test.id(), "passed": False, "error": short_error(err[1])})
        def addError(self, test, err):
            name = test.id() if hasattr(test, "id") else str(test)
            error = "timed out after %gs" % spec["timeout"] if err[0] is Timeout else short_error(err[1])
            results.append({"name": name, "passed": False, "error": error})
        def addSkip(self, test, reason):
            results.append({"name": test.id(), "passed": False, "error": "skipped: " + reason})
        def addExpectedFailure(self, test, err):
            results.append({"name": test.id(), "passed": True})
        def addUnexpectedSuccess(self, test):
            results.append({"name": test.id(), "passed": False, "error": "unexpected success"})
    try:
        suite = unittest.TestLoader().discover("tests", top_level_dir=".")
        suite.run(Result())
    except BaseException as exc:
        return {"error": "collecting tests failed: " + short_error(exc), "tests": results}
    return {"tests": results}

def main():
    marker = sys.stdin.readline().strip()
    sys.stdin = io.StringIO("")
    out = os.fdopen(os.dup(1), "w")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.remove(sys.argv[1])
    captured = io.StringIO()
    sys.stdout = captured
    sys.path.insert(0, os.getcwd())
    try:
        if spec["mode"] == "functions":
            report = run_functions(spec, captured)
        else:
            report = run_unittest(spec, captured)
    except BaseException as exc:
        report = {"error": "the grader failed: " + short_error(exc), "tests": []}
    report["output"] = captured.getvalue()[-2000:]
    out.write(marker + json.dumps(report) + "\n")
    out.flush()
    os._exit(0)

main()
"#;

/// One test's result.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TestResult {
    /// The test's name (repository tests) or none (snippets, in order).
    #[serde(default)]
    pub name: Option<String>,
    /// Whether it passed.
    pub passed: bool,
    /// Why not.
    #[serde(default)]
    pub error: Option<String>,
}

/// The results of one test run.
#[derive(Debug, Clone, PartialEq)]
pub struct TestRun {
    /// Per test, in order.
    pub tests: Vec<TestResult>,
    /// A problem that stopped the tests (import failure, a limit, a crash).
    pub error: Option<String>,
    /// What the agent's code printed (the end of it).
    pub output: String,
}

impl TestRun {
    /// Tests that passed.
    pub fn passed(&self) -> usize {
        self.tests.iter().filter(|t| t.passed).count()
    }

    /// A run where nothing could be counted: every expected test fails with `error`.
    fn failed(expected: usize, error: String) -> Self {
        Self {
            tests: (0..expected)
                .map(|_| TestResult {
                    name: None,
                    passed: false,
                    error: Some(error.clone()),
                })
                .collect(),
            error: Some(error),
            output: String::new(),
        }
    }
}

#[derive(Deserialize)]
struct Report {
    tests: Vec<TestResult>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    output: String,
}

/// What to run.
pub enum Suite<'a> {
    /// Snippets against `solution.py`.
    Snippets(&'a [String]),
    /// `unittest` discovery under `tests/`.
    Unittest,
}

/// Runs `suite` over `files` in a fresh sandbox.
pub async fn run_tests(
    sandbox: &Sandbox,
    files: &BTreeMap<String, String>,
    suite: Suite<'_>,
    marker: &str,
) -> Result<TestRun, agentstack_sandbox::Error> {
    let (spec, expected) = match &suite {
        Suite::Snippets(tests) => (
            json!({"mode": "functions", "module": "solution", "tests": tests, "timeout": TEST_TIMEOUT.as_secs_f64()}),
            tests.len(),
        ),
        Suite::Unittest => (
            json!({"mode": "unittest", "timeout": TEST_TIMEOUT.as_secs_f64()}),
            0,
        ),
    };
    let mut job = Job::new(["python3", GRADER_FILE, SPEC_FILE]);
    job.files = files
        .iter()
        .filter(|(path, _)| path.as_str() != GRADER_FILE && path.as_str() != SPEC_FILE)
        .map(|(path, contents)| JobFile::new(path.clone(), contents.as_bytes()))
        .collect();
    job.files.push(JobFile::new(GRADER_FILE, GRADER));
    job.files.push(JobFile::new(SPEC_FILE, spec.to_string()));
    job.stdin = format!("{marker}\n").into_bytes();
    let tests = expected.max(1) as u32;
    job.limits = Limits {
        wall: TEST_TIMEOUT * (tests + 10).min(60) + Duration::from_secs(5),
        cpu: TEST_TIMEOUT * (tests + 10).min(60) + Duration::from_secs(5),
        ..Limits::default()
    };
    let outcome = sandbox.run(&job).await?;
    let stdout = outcome.stdout_text();
    let report = stdout
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix(marker))
        .and_then(|json| serde_json::from_str::<Report>(json).ok());
    Ok(match report {
        Some(report) => TestRun {
            tests: report.tests,
            error: report.error,
            output: report.output,
        },
        None => {
            let why = match outcome.end {
                End::Exited { .. } => "the test run ended without reporting results".to_owned(),
                other => format!("the test run {other}"),
            };
            let stderr = outcome.stderr_text();
            let tail: String = stderr
                .chars()
                .rev()
                .take(800)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            TestRun::failed(
                expected,
                if tail.trim().is_empty() {
                    why
                } else {
                    format!("{why}: {}", tail.trim())
                },
            )
        }
    })
}

/// A test run as text for the agent: a summary line, then each failure.
pub fn describe(run: &TestRun, sources: Option<&[String]>) -> String {
    let mut text = format!("{}/{} tests passed", run.passed(), run.tests.len());
    if let Some(error) = &run.error {
        text.push_str(&format!("\nerror: {error}"));
    }
    for (i, test) in run.tests.iter().enumerate() {
        if test.passed {
            continue;
        }
        let name = match (&test.name, sources.and_then(|s| s.get(i))) {
            (Some(name), _) => name.clone(),
            (None, Some(source)) => source.trim().to_owned(),
            (None, None) => format!("test {}", i + 1),
        };
        text.push_str(&format!(
            "\nFAILED {name}: {}",
            test.error.as_deref().unwrap_or("failed")
        ));
    }
    if !run.output.trim().is_empty() {
        text.push_str(&format!(
            "\n--- printed output ---\n{}",
            run.output.trim_end()
        ));
    }
    text
}
