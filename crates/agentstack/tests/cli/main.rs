//! The real binary, run in a temporary home: exit codes, stdout and stderr.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use assert_cmd::cargo::CommandCargoExt;

struct Output {
    code: i32,
    stdout: String,
    stderr: String,
}

fn agentstack(args: &[&str]) -> Output {
    let home = tempfile::tempdir().unwrap();
    let out = Command::cargo_bin("agentstack")
        .unwrap()
        .args(args)
        .env("HOME", home.path())
        .env("AGENTSTACK_HOME", home.path().join("data"))
        .env_remove("AGENTSTACK_LOG")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn snapshot(out: &Output) -> String {
    format!("exit: {}\n--- stdout\n{}--- stderr\n{}", out.code, out.stdout, out.stderr)
}

#[test]
fn env_list() {
    insta::assert_snapshot!(snapshot(&agentstack(&["env", "list"])));
}

#[test]
fn serve_unknown_target_says_what_exists() {
    insta::assert_snapshot!(snapshot(&agentstack(&["env", "serve", "nope", "--port", "0"])));
}

#[test]
fn run_rejects_options_that_are_not_an_object() {
    insta::assert_snapshot!(snapshot(&agentstack(&["env", "run", "echo", "--options", "[1]"])));
}

#[test]
fn validate_unreachable_url_exits_2() {
    let out = agentstack(&["env", "validate", "http://127.0.0.1:9"]);
    assert_eq!(out.code, 2, "{}", snapshot(&out));
    assert!(out.stderr.contains("could not reach http://127.0.0.1:9"), "{}", out.stderr);
}

#[test]
fn validate_builtin_passes_and_reports_json() {
    let out = agentstack(&["env", "validate", "connect_four", "--json"]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["passed"], true);
}

#[test]
fn run_builtin_json_lines() {
    let out = agentstack(&["env", "run", "word_guess", "-n", "3", "--json", "--seed", "5"]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    let lines: Vec<serde_json::Value> = out.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["episode"], i);
        assert_eq!(line["seed"], 5 + i);
        assert!(line["total_reward"].is_number());
    }
    // Same seeds, same episodes.
    let again = agentstack(&["env", "run", "word_guess", "-n", "3", "--json", "--seed", "5"]);
    let strip = |s: &str| s.lines().map(|l| {
        let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
        v.as_object_mut().unwrap().remove("seconds");
        v
    }).collect::<Vec<_>>();
    assert_eq!(strip(&out.stdout), strip(&again.stdout));
}

#[test]
fn init_python_then_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().to_str().unwrap();
    let out = agentstack(&["env", "init", "demo_env", "--lang", "python", "-o", parent]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    assert!(dir.path().join("demo_env/openenv.yaml").is_file());
    assert!(dir.path().join("demo_env/server/app.py").is_file());
    let again = agentstack(&["env", "init", "demo_env", "--lang", "python", "-o", parent]);
    assert_eq!(again.code, 1);
    assert!(again.stderr.contains("already exists"), "{}", again.stderr);
    let bad = agentstack(&["env", "init", "Bad-Name", "-o", parent]);
    assert_eq!(bad.code, 1);
    assert!(bad.stderr.contains("not a valid environment name"), "{}", bad.stderr);
}

#[test]
fn serve_prints_urls_and_stops_cleanly_on_sigterm() {
    let mut child = Command::cargo_bin("agentstack")
        .unwrap()
        .args(["env", "serve", "echo", "arithmetic", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("listening on http://127.0.0.1:"), "{first}");
    let url = first.trim_start_matches("listening on ").to_owned();
    let echo = lines.next().unwrap().unwrap();
    assert_eq!(echo.split_whitespace().collect::<Vec<_>>(), ["echo", &format!("{url}/echo")]);
    let out = agentstack(&["env", "run", &format!("{url}/arithmetic"), "-n", "2"]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "server did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}
