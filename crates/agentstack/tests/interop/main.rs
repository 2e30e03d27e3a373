//! Interop with the real OpenEnv Python packages, both directions:
//!
//! - their clients against our server: `agentstack env serve echo arithmetic
//!   connect_four word_guess` driven by the scripts in `tests/interop/` with
//!   `openenv` 0.10.0 (`GenericEnvClient` sync and async, `MCPToolClient`) and
//!   `openenv-core` 0.3.0, and `openenv validate --url`; `GenericEnvClient` with an
//!   API key (`headers=`) against a server started with one;
//! - our client against their servers: the package `openenv init` generates and an
//!   MCP echo package (`tests/interop/fixtures/mcp_echo_env`), served by
//!   `agentstack env serve <dir> --python <venv python>` and driven by
//!   `agentstack env run` and `agentstack env validate`;
//! - their client through our reverse proxy to their server;
//! - packages of the shapes found in OpenEnv's own repository (no manifest,
//!   package-relative imports, own episode ids, 500s that drop the connection,
//!   refused WebSockets) hosted by `agentstack env serve` ([`foreign_envs`]);
//! - the official `openai` Python client against `agentstack model serve` on the
//!   SmolLM2 test model: chat, streaming, tools, JSON schema, logprobs, errors;
//! - `agentstack env import` on small `verifiers` environments, the packages it
//!   writes validated, served and driven by both clients ([`verifiers`]).
//!
//! The peers live in virtual environments made by `scripts/install-peers`; every test
//! is `#[ignore]`d because it needs them, and CI runs ignored tests:
//!
//! ```sh
//! scripts/install-peers
//! cargo nextest run -p agentstack --test interop --run-ignored all
//! ```

mod foreign_envs;
mod verifiers;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use agentstack_test_support::peers::{openenv_python, peer_python, test_model};
use agentstack_test_support::processes::{Finished, Server, run_bounded};
use serde_json::Value;

/// How long our own server may take to print its address.
const SERVER_READY: Duration = Duration::from_secs(60);

/// How long `agentstack env serve <python package>` may take to print its address:
/// importing `openenv` alone takes seconds on a busy machine.
const PEER_SERVER_READY: Duration = Duration::from_secs(180);

/// `--ready-timeout` handed to `agentstack env serve` for a Python package, seconds.
const PEER_READY_TIMEOUT_S: &str = "150";

/// The most one Python client script or `openenv` command may take.
const PEER_COMMAND_LIMIT: Duration = Duration::from_secs(240);

/// The most one `agentstack env run`/`validate` against a peer server may take.
const CLI_LIMIT: Duration = Duration::from_secs(120);

/// Episodes `agentstack env run` drives against each peer server.
const EPISODES: usize = 3;

/// The checks `openenv validate --url` runs against a server.
const OPENENV_URL_CHECKS: u64 = 6;

/// The built-in environments the Python clients are pointed at.
const BUILTINS: [&str; 4] = ["echo", "arithmetic", "connect_four", "word_guess"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root exists")
}

fn interop_dir() -> PathBuf {
    repo_root().join("tests/interop")
}

/// Python with the official `openai` client.
fn openai_python() -> PathBuf {
    peer_python("AGENTSTACK_OPENAI_PYTHON", "venv-openai-3.57.0")
}

/// The SmolLM2 test model from `scripts/fetch-model`.
/// Python with `openenv-core` 0.3.0.
fn openenv030_python() -> PathBuf {
    peer_python("AGENTSTACK_OPENENV030_PYTHON", "venv-openenv-core-0.3.0")
}

/// A command for a peer's Python that leaves no bytecode in the source tree.
fn python_command(python: &Path) -> Command {
    let mut command = Command::new(python);
    command
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1");
    command
}

fn agentstack() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_agentstack"));
    command.env("PYTHONDONTWRITEBYTECODE", "1");
    command
}

/// Our server with the built-in environments, each under `/<name>`.
fn serve_builtins() -> Server {
    let mut command = agentstack();
    command
        .args(["env", "serve"])
        .args(BUILTINS)
        .args(["--port", "0"]);
    Server::start(command, SERVER_READY)
}

/// A Python OpenEnv package served by `agentstack env serve <dir> --python ...`,
/// proxied at the root of the printed URL.
fn serve_peer_package(dir: &Path) -> Server {
    let mut command = agentstack();
    command
        .args(["env", "serve"])
        .arg(dir)
        .arg("--python")
        .arg(openenv_python())
        .args(["--port", "0", "--ready-timeout", PEER_READY_TIMEOUT_S]);
    Server::start(command, PEER_SERVER_READY)
}

fn assert_success(finished: &Finished, server: &mut Server, what: &str) {
    assert!(
        finished.success(),
        "{what} failed\n{finished}\n{}",
        server.report()
    );
}

/// Runs one of the Python client scripts against `server` (with `extra` arguments
/// after its URL) and expects exit 0.
fn run_client_script(python: &Path, script: &str, server: &mut Server, extra: &[&str]) {
    let mut command = python_command(python);
    command
        .current_dir(interop_dir())
        .arg(interop_dir().join(script))
        .arg(&server.url)
        .args(extra);
    let finished = run_bounded(command, PEER_COMMAND_LIMIT);
    assert_success(&finished, server, script);
    // Shown with --nocapture / on nextest failure: what was checked.
    println!("{}", finished.stdout);
}

#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn generic_client_0_10_sync_and_async() {
    let python = openenv_python();
    let mut server = serve_builtins();
    run_client_script(&python, "client_generic.py", &mut server, &[]);
}

/// Regression: `env serve` had no API keys. Started with one, it refuses the real
/// client's WebSocket with 401 until the client sends `headers={"Authorization":
/// "Bearer KEY"}` (its own way to send a token); then an episode runs.
#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn generic_client_0_10_sends_an_api_key() {
    let python = openenv_python();
    let key = "interop-key-1618";
    let mut command = agentstack();
    command
        .args(["env", "serve", "echo", "--port", "0"])
        .env("AGENTSTACK_API_KEY", format!("{key},interop-other-key"));
    let mut server = Server::start(command, SERVER_READY);
    let mut script = python_command(&python);
    script
        .current_dir(interop_dir())
        .arg(interop_dir().join("client_api_key.py"))
        .arg(&server.url)
        .env("AGENTSTACK_API_KEY", key);
    let finished = run_bounded(script, PEER_COMMAND_LIMIT);
    assert_success(&finished, &mut server, "client_api_key.py");
    println!("{}", finished.stdout);
}

#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn mcp_tool_client_0_10() {
    let python = openenv_python();
    let mut server = serve_builtins();
    run_client_script(&python, "client_mcp.py", &mut server, &[]);
}

#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn core_0_3_generic_and_mcp_clients() {
    let python = openenv030_python();
    let mut server = serve_builtins();
    run_client_script(&python, "client_core030.py", &mut server, &[]);
}

#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn openenv_clients_drive_the_coding_environment() {
    let python = openenv_python();
    let mut command = agentstack();
    command.args(["env", "serve", "coding", "--port", "0"]);
    let mut server = Server::start(command, SERVER_READY);
    let url = format!("{}/coding", server.url);
    let mut command = python_command(&python);
    command
        .current_dir(interop_dir())
        .arg(interop_dir().join("client_coding.py"))
        .arg(&url);
    let finished = run_bounded(command, PEER_COMMAND_LIMIT);
    assert_success(&finished, &mut server, "client_coding.py");
    println!("{}", finished.stdout);
    let mut command = python_command(&python);
    command.args(["-m", "openenv.cli", "validate", "--url", &url, "--json"]);
    let finished = run_bounded(command, PEER_COMMAND_LIMIT);
    assert_success(&finished, &mut server, "openenv validate --url (coding)");
    let report: Value = serde_json::from_str(&finished.stdout).unwrap_or_else(|e| {
        panic!("openenv validate --json printed no JSON report: {e}\n{finished}")
    });
    assert_eq!(report["passed"], true, "{finished}");
}

#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn openenv_validate_url_passes_our_echo() {
    let python = openenv_python();
    let mut server = serve_builtins();
    let url = format!("{}/echo", server.url);
    let mut command = python_command(&python);
    command.args(["-m", "openenv.cli", "validate", "--url", &url, "--json"]);
    let finished = run_bounded(command, PEER_COMMAND_LIMIT);
    assert_success(&finished, &mut server, "openenv validate --url");

    let report: Value = serde_json::from_str(&finished.stdout).unwrap_or_else(|e| {
        panic!("openenv validate --json printed no JSON report: {e}\n{finished}")
    });
    let failed: Vec<&Value> = report["criteria"]
        .as_array()
        .map(|c| c.iter().filter(|c| c["passed"] != true).collect())
        .unwrap_or_default();
    assert!(
        failed.is_empty(),
        "openenv validate failed criteria: {failed:#?}\n{finished}"
    );
    assert_eq!(report["passed"], true, "{finished}");
    let summary = &report["summary"];
    assert_eq!(
        (
            summary["passed_count"].as_u64(),
            summary["total_count"].as_u64()
        ),
        (Some(OPENENV_URL_CHECKS), Some(OPENENV_URL_CHECKS)),
        "openenv validate should pass {OPENENV_URL_CHECKS}/{OPENENV_URL_CHECKS}: {summary}"
    );
    assert_eq!(report["standard_profile"], "openenv-http/1.x", "{finished}");
}

/// `agentstack env run <url> --policy random --episodes <episodes>` against a peer
/// server: it must succeed and print a row for each episode.
fn run_random_episodes(server: &mut Server, episodes: usize) -> Finished {
    let mut command = agentstack();
    command
        .args([
            "env",
            "run",
            &server.url,
            "--policy",
            "random",
            "--episodes",
        ])
        .arg(episodes.to_string());
    let run = run_bounded(command, CLI_LIMIT);
    assert_success(&run, server, "agentstack env run");
    let episode_rows = run
        .stdout
        .lines()
        .filter(|line| line.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .count();
    assert!(
        episode_rows >= episodes,
        "env run printed {episode_rows} episode rows, wanted {episodes}\n{run}"
    );
    println!("{}", run.stdout);
    run
}

/// A current-thread Tokio runtime for a test's client calls.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// `agentstack env run <url> --episodes 3 --policy random` and `agentstack env
/// validate <url>` against a peer server, both expected to succeed.
fn drive_peer_with_our_client(server: &mut Server) {
    let run = run_random_episodes(server, EPISODES);
    assert!(
        run.stdout.contains("reward"),
        "env run printed no rewards\n{run}"
    );

    let mut command = agentstack();
    command.args(["env", "validate", &server.url]);
    let validate = run_bounded(command, CLI_LIMIT);
    assert_success(&validate, server, "agentstack env validate");
    println!("{}", validate.stdout);
}

#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn our_client_drives_openenv_init_package() {
    let python = openenv_python();
    // Generated at run time by the real CLI rather than committed: the test follows
    // whatever template the installed openenv ships.
    let scratch = tempfile::tempdir().expect("a temp dir");
    let mut command = python_command(&python);
    command
        .current_dir(scratch.path())
        .args(["-m", "openenv.cli", "init", "demo_env", "-o"])
        .arg(scratch.path());
    let init = run_bounded(command, PEER_COMMAND_LIMIT);
    assert!(init.success(), "openenv init failed\n{init}");
    let package = scratch.path().join("demo_env");
    assert!(
        package.join("openenv.yaml").is_file(),
        "openenv init made no demo_env/openenv.yaml\n{init}"
    );

    let mut server = serve_peer_package(&package);
    drive_peer_with_our_client(&mut server);
}

#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn our_client_drives_mcp_echo_package() {
    let mut server = serve_peer_package(&interop_dir().join("fixtures/mcp_echo_env"));
    drive_peer_with_our_client(&mut server);
}

/// The proxy in front of a Python package is transparent to the real clients:
/// `MCPToolClient` (HTTP `/mcp` plus `/ws?session_id`) and tool steps over `/ws`.
#[test]
#[ignore = "needs the OpenEnv venvs from scripts/install-peers"]
fn python_mcp_client_through_our_proxy() {
    let python = openenv_python();
    let mut server = serve_peer_package(&interop_dir().join("fixtures/mcp_echo_env"));
    // The package is served at the root of the proxy, not under /echo.
    run_client_script(&python, "client_mcp.py", &mut server, &["/"]);
}

#[test]
#[ignore = "needs the openai venv and the SmolLM2 model from scripts/install-peers"]
fn openai_client_talks_to_model_serve() {
    let python = openai_python();
    let mut command = agentstack();
    command
        .args(["model", "serve"])
        .arg(test_model())
        .args(["--port", "0", "--threads", "1"]);
    let mut server = Server::start(command, SERVER_READY);
    let mut script = python_command(&python);
    script
        .arg(interop_dir().join("openai_client.py"))
        .arg(format!("{}/v1", server.url));
    let finished = run_bounded(script, PEER_COMMAND_LIMIT);
    assert_success(&finished, &mut server, "openai_client.py");
    println!("{}", finished.stdout);
}
