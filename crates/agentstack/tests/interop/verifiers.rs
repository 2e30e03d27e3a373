//! `agentstack env import` against the real `verifiers` package: small verifiers
//! environments written here (no model, no download: the datasets are in memory) are
//! imported, validated, served, and driven by the OpenEnv Python client and by ours.

use std::path::{Path, PathBuf};

use agentstack_env::client::{ClientConfig, EnvClient};
use agentstack_protocol::http::ResetRequest;
use serde_json::{Value, json};

use super::{
    PEER_COMMAND_LIMIT, PEER_READY_TIMEOUT_S, PEER_SERVER_READY, agentstack, assert_success,
    interop_dir, peer_python, python_command, runtime,
};
use agentstack_test_support::processes::{Server, run_bounded};

/// The verifiers release the import is tested with: the newest that installs beside
/// `openenv` 0.10.0 (0.4.0 pins `mcp==2.0.0`, which openenv's `fastmcp<4` excludes,
/// and no longer exports the `load_environment` API).
const VERIFIERS_VERSION: &str = "0.3.1";

/// Rewards travel as JSON numbers; compare them with this tolerance.
const REWARD_TOLERANCE: f64 = 1e-9;

/// A single-turn environment: three sums, an async exact-answer reward (weight 1)
/// and a sync brevity reward (weight 0.5), so a short correct answer scores 1.5.
const ARITH_ENV: &str = r#"
import verifiers as vf
from datasets import Dataset

PROBLEMS = [("What is 2 + 3?", "5"), ("What is 7 * 6?", "42"), ("What is 10 - 4?", "6")]


def load_environment(**kwargs):
    dataset = Dataset.from_list([{"question": q, "answer": a} for q, a in PROBLEMS])

    async def exact_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (completion[-1]["content"] or "").strip() == answer else 0.0

    def brevity(completion) -> float:
        return 1.0 if len(completion[-1]["content"] or "") <= 10 else 0.0

    rubric = vf.Rubric(funcs=[exact_answer, brevity], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(
        dataset=dataset, system_prompt="Answer with the number only.", rubric=rubric
    )
"#;

/// The fixture's questions and answers, for the clients.
const ARITH_ANSWERS: [(&str, &str); 3] = [
    ("What is 2 + 3?", "5"),
    ("What is 7 * 6?", "42"),
    ("What is 10 - 4?", "6"),
];

/// `exact_answer` × 1 + `brevity` × 0.5.
const ARITH_FULL_REWARD: f64 = 1.5;

/// A multi-turn environment: guess a number, told "higher" or "lower" until right
/// (the rollout ends with a final env response) or out of turns.
const GUESS_ENV: &str = r#"
import verifiers as vf
from datasets import Dataset


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        guess = (messages[-1]["content"] or "").strip()
        target = int(state["answer"])
        if guess.isdigit() and int(guess) == target:
            state["solved"] = True
            state["final_env_response"] = [vf.UserMessage(content="correct")]
            return state["final_env_response"]
        hint = "higher" if not guess.isdigit() or int(guess) < target else "lower"
        return [vf.UserMessage(content=hint)]


def load_environment(max_turns: int = 10, **kwargs):
    dataset = Dataset.from_list([{"question": "Guess my number (1-10).", "answer": "7"}])

    def solved(state) -> float:
        return 1.0 if state.get("solved") else 0.0

    return GuessEnv(dataset=dataset, rubric=vf.Rubric(funcs=[solved]), max_turns=max_turns)
"#;

/// The project file `vf-init` writes beside the module.
const GUESS_PYPROJECT: &str = r#"
[project]
name = "guess-env"
version = "0.1.0"
dependencies = ["verifiers>=0.3", "numpy>=1.26"]
"#;

/// Python with verifiers and openenv 0.10.0.
fn verifiers_python() -> PathBuf {
    peer_python(
        "AGENTSTACK_VERIFIERS_PYTHON",
        &format!("venv-verifiers-{VERIFIERS_VERSION}"),
    )
}

/// `agentstack env import <source> --out <out> --python <py> [extra]`, expected to
/// succeed; returns the package directory.
fn import(python: &Path, source: &Path, out: &Path, extra: &[&str]) -> PathBuf {
    let mut command = agentstack();
    command
        .args(["env", "import"])
        .arg(source)
        .arg("--out")
        .arg(out)
        .arg("--python")
        .arg(python)
        .args(extra)
        // Everything the environments need is local; prove it.
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1");
    let finished = run_bounded(command, PEER_COMMAND_LIMIT);
    assert!(finished.success(), "env import failed\n{finished}");
    assert!(
        finished.stdout.contains("created "),
        "env import said nothing\n{finished}"
    );
    println!("{}", finished.stdout);
    out.to_owned()
}

fn serve(python: &Path, package: &Path) -> Server {
    let mut command = agentstack();
    command
        .args(["env", "serve"])
        .arg(package)
        .arg("--python")
        .arg(python)
        .args(["--port", "0", "--ready-timeout", PEER_READY_TIMEOUT_S])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1");
    Server::start(command, PEER_SERVER_READY)
}

fn manifest(package: &Path) -> String {
    std::fs::read_to_string(package.join("openenv.yaml")).expect("openenv.yaml")
}

/// Whether `yaml` has the line `line` (keys are written one per line, top level first).
fn has_line(yaml: &str, line: &str) -> bool {
    yaml.lines().any(|l| l == line)
}

fn assert_reward(got: Option<f64>, want: f64, what: &str) {
    let ok = got.is_some_and(|r| (r - want).abs() <= REWARD_TOLERANCE);
    assert!(ok, "{what}: reward {got:?}, wanted {want}");
}

#[test]
#[ignore = "needs the verifiers venv from scripts/install-peers"]
fn verifiers_single_turn_env_imports_validates_and_scores() {
    let python = verifiers_python();
    let scratch = tempfile::tempdir().expect("a temp dir");
    let source = scratch.path().join("arith_env.py");
    std::fs::write(&source, ARITH_ENV).expect("writing the fixture");
    let package = import(&python, &source, &scratch.path().join("arith"), &[]);

    let yaml = manifest(&package);
    for line in [
        "name: arith_env",
        "app: server.app:app",
        "agentstack:",
        "  reward_range: [0.0, 1.5]",
    ] {
        assert!(
            has_line(&yaml, line),
            "openenv.yaml lacks `{line}`:\n{yaml}"
        );
    }
    assert!(package.join("source/arith_env.py").is_file());
    let requirements = std::fs::read_to_string(package.join("requirements.txt")).unwrap();
    assert!(
        requirements.contains(&format!("verifiers=={VERIFIERS_VERSION}\n"))
            && requirements.contains("openenv==0.10.0\n"),
        "{requirements}"
    );

    // Our validator, which serves the package itself.
    let mut command = agentstack();
    command
        .args(["env", "validate"])
        .arg(&package)
        .arg("--python")
        .arg(&python)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1");
    let validate = run_bounded(command, PEER_COMMAND_LIMIT);
    assert!(
        validate.success(),
        "env validate failed on the imported package\n{validate}"
    );
    assert!(validate.stdout.contains("reward_well_formed"), "{validate}");
    println!("{}", validate.stdout);

    let mut server = serve(&python, &package);

    // The real OpenEnv Python client.
    let answers: serde_json::Map<String, Value> = ARITH_ANSWERS
        .iter()
        .map(|(q, a)| ((*q).to_owned(), json!(a)))
        .collect();
    let mut command = python_command(&python);
    command
        .current_dir(interop_dir())
        .arg(interop_dir().join("client_verifiers.py"))
        .arg(&server.url)
        .arg(Value::Object(answers).to_string())
        .arg(ARITH_FULL_REWARD.to_string());
    let finished = run_bounded(command, PEER_COMMAND_LIMIT);
    assert_success(&finished, &mut server, "client_verifiers.py");
    println!("{}", finished.stdout);

    // Our client: every example, answered right and wrong.
    let url = server.url.clone();
    let outcome = runtime().block_on(async move {
        let mut client = EnvClient::connect(&url, ClientConfig::default())
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut seen = Vec::new();
        for (index, (question, answer)) in ARITH_ANSWERS.iter().enumerate() {
            for (reply, right) in [(*answer, true), ("0", false)] {
                let mut reset = ResetRequest::default();
                reset.options.insert("index".into(), json!(index));
                let first = client
                    .reset(reset)
                    .await
                    .map_err(|e| format!("reset: {e}"))?;
                if first.observation["prompt"] != json!(question) {
                    return Err(format!("example {index}: {:?}", first.observation));
                }
                let step = client
                    .step(&json!({ "message": reply }))
                    .await
                    .map_err(|e| format!("step: {e}"))?;
                if !step.done {
                    return Err(format!("a single-turn episode did not end: {step:?}"));
                }
                seen.push((right, step.reward, step.observation["metrics"].clone()));
            }
        }
        client.close().await.map_err(|e| format!("close: {e}"))?;
        Ok::<_, String>(seen)
    });
    let seen = outcome.unwrap_or_else(|e| panic!("{e}\n{}", server.report()));
    for (right, reward, metrics) in seen {
        if right {
            assert_reward(reward, ARITH_FULL_REWARD, "a correct answer");
            assert_eq!(metrics["exact_answer"], json!(1.0), "{metrics}");
        } else {
            // Wrong but short: the brevity reward alone.
            assert_reward(reward, 0.5, "a wrong answer");
            assert_eq!(metrics["exact_answer"], json!(0.0), "{metrics}");
        }
    }
}

#[test]
#[ignore = "needs the verifiers venv from scripts/install-peers"]
fn verifiers_multi_turn_project_directory_with_args() {
    let python = verifiers_python();
    let scratch = tempfile::tempdir().expect("a temp dir");
    // vf-init's layout: environments/<id>/<id>.py beside its pyproject.toml.
    let project = scratch.path().join("guess-env");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::write(project.join("guess_env.py"), GUESS_ENV).unwrap();
    std::fs::write(project.join("pyproject.toml"), GUESS_PYPROJECT).unwrap();
    let package = import(
        &python,
        &project,
        &scratch.path().join("guess"),
        &["--name", "guess", "--args", r#"{"max_turns": 4}"#],
    );
    assert!(has_line(&manifest(&package), "name: guess"));
    assert!(package.join("source/guess_env.py").is_file());
    assert!(package.join("source/pyproject.toml").is_file());
    let requirements = std::fs::read_to_string(package.join("requirements.txt")).unwrap();
    assert_eq!(
        requirements,
        format!("verifiers=={VERIFIERS_VERSION}\nopenenv==0.10.0\nnumpy>=1.26\n")
    );

    let mut server = serve(&python, &package);
    let url = server.url.clone();
    let outcome = runtime().block_on(async move {
        let mut client = EnvClient::connect(&url, ClientConfig::default())
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut transcript = Vec::new();
        // Solved on the third guess; then never solved within max_turns = 4.
        for guesses in [&["3", "9", "7"][..], &["1", "2", "3", "4"]] {
            let first = client
                .reset(ResetRequest::default())
                .await
                .map_err(|e| format!("reset: {e}"))?;
            transcript.push((
                first.observation["prompt"].clone(),
                first.done,
                first.reward,
            ));
            for &guess in guesses {
                let step = client
                    .step(&json!({ "message": guess }))
                    .await
                    .map_err(|e| format!("step {guess}: {e}"))?;
                transcript.push((step.observation["prompt"].clone(), step.done, step.reward));
                if step.done {
                    transcript.push((step.observation["stop_condition"].clone(), true, None));
                }
            }
        }
        client.close().await.map_err(|e| format!("close: {e}"))?;
        Ok::<_, String>(transcript)
    });
    let transcript = outcome.unwrap_or_else(|e| panic!("{e}\n{}", server.report()));
    let texts: Vec<(Value, bool)> = transcript.iter().map(|(t, d, _)| (t.clone(), *d)).collect();
    assert_eq!(
        texts,
        [
            (json!("Guess my number (1-10)."), false),
            (json!("higher"), false),
            (json!("lower"), false),
            (json!("correct"), true),
            (json!("has_final_env_response"), true),
            (json!("Guess my number (1-10)."), false),
            (json!("higher"), false),
            (json!("higher"), false),
            (json!("higher"), false),
            // The fourth reply uses the last turn; the rollout stops before answering it.
            (json!(""), true),
            (json!("max_turns_reached"), true),
        ],
        "{transcript:?}"
    );
    assert_reward(transcript[3].2, 1.0, "solved");
    assert_reward(transcript[9].2, 0.0, "out of turns");
    for (_, done, reward) in &transcript {
        if !done {
            assert_eq!(*reward, None, "no reward before the end: {transcript:?}");
        }
    }
}

/// A tool environment: the reply calls `add`, the rollout runs it and shows the result.
const CALC_ENV: &str = r#"
import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


def load_environment(**kwargs):
    dataset = Dataset.from_list([{"question": "What is 123 + 456? Use the tool.", "answer": "579"}])

    def correct(completion, answer) -> float:
        return 1.0 if answer in (completion[-1]["content"] or "") else 0.0

    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=vf.Rubric(funcs=[correct]), max_turns=4)
"#;

#[test]
#[ignore = "needs the verifiers venv from scripts/install-peers"]
fn verifiers_tool_env_runs_the_agents_tool_calls() {
    let python = verifiers_python();
    let scratch = tempfile::tempdir().expect("a temp dir");
    let source = scratch.path().join("calc_env.py");
    std::fs::write(&source, CALC_ENV).expect("writing the fixture");
    let package = import(&python, &source, &scratch.path().join("calc"), &[]);
    let mut server = serve(&python, &package);
    let url = server.url.clone();
    let outcome = runtime().block_on(async move {
        let mut client = EnvClient::connect(&url, ClientConfig::default())
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let first = client
            .reset(ResetRequest::default())
            .await
            .map_err(|e| format!("reset: {e}"))?;
        // OpenAI's shape of a tool call; the bridge also takes {"id", "name", "arguments"}.
        let call = json!({
            "message": "",
            "tool_calls": [{
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": "{\"a\": 123, \"b\": 456}"},
            }],
        });
        let tool = client
            .step(&call)
            .await
            .map_err(|e| format!("step with a tool call: {e}"))?;
        let last = client
            .step(&json!({"message": "The answer is 579."}))
            .await
            .map_err(|e| format!("final step: {e}"))?;
        client.close().await.map_err(|e| format!("close: {e}"))?;
        Ok::<_, String>((first, tool, last))
    });
    let (first, tool, last) = outcome.unwrap_or_else(|e| panic!("{e}\n{}", server.report()));
    assert_eq!(
        first.observation["tools"][0]["name"], "add",
        "{:?}",
        first.observation
    );
    assert!(!tool.done, "{tool:?}");
    assert_eq!(tool.observation["prompt"], "579", "{tool:?}");
    assert_eq!(
        tool.observation["messages"]
            .as_array()
            .and_then(|m| m.last()),
        Some(&json!({"role": "tool", "tool_call_id": "call_1", "content": "579"})),
        "{tool:?}"
    );
    assert!(last.done, "{last:?}");
    assert_reward(last.reward, 1.0, "the correct final answer");
    assert_eq!(last.observation["metrics"]["total_tool_calls"], json!(1.0));
    assert_eq!(last.observation["stop_condition"], "no_tools_called");
}
