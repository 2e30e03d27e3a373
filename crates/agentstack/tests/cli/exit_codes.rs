//! Exit codes (issue 22): 1 for the user's errors, 2 for everything else, and every
//! cause of an error printed once.

use super::{agentstack, agentstack_in, assert_user_errors, snapshot};

/// Regression: a launch state database that cannot be opened read as the user's
/// error (exit 1). It is ours: exit 2, and the message says which file.
#[test]
fn a_corrupt_launch_state_is_an_internal_error() {
    let home = tempfile::tempdir().unwrap();
    let jobs = home.path().join("data/jobs");
    std::fs::create_dir_all(&jobs).unwrap();
    std::fs::write(jobs.join("jobs.db"), "not a database ".repeat(64)).unwrap();
    for args in [&["status"][..], &["logs", "x"], &["cancel", "x"]] {
        let out = agentstack_in(home.path(), args);
        assert_eq!(out.code, 2, "{args:?}\n{}", snapshot(&out));
        insta::with_settings!({filters => vec![(home.path().to_str().unwrap(), "[HOME]")]}, {
            insta::assert_snapshot!("corrupt_launch_state", snapshot(&out));
        });
    }
}

/// Errors that reached `?` unmarked were all exit 1; now unmarked means internal, so
/// each user error the commands raise that way is marked. These are the ones no
/// other test covers.
#[test]
fn user_errors_still_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let not_gguf = dir.path().join("fake.gguf");
    std::fs::write(&not_gguf, b"this is not a model").unwrap();
    let not_gguf = not_gguf.to_str().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let empty = empty.to_str().unwrap();
    let cases: [(&[&str], &str); 11] = [
        (
            &["env", "validate", "hub:Alice/x"],
            "'Alice' is not a valid owner name",
        ),
        (
            &["env", "serve", empty, "--port", "0"],
            "neither an openenv.yaml nor a server/app.py",
        ),
        (
            &["model", "generate", not_gguf, "hi"],
            "not a readable GGUF file",
        ),
        (
            &["model", "generate", not_gguf, "hi", "--threads", "0"],
            "--threads must be at least 1",
        ),
        (
            &[
                "model",
                "imatrix",
                not_gguf,
                "--text",
                "/nonexistent.txt",
                "-o",
                "x",
            ],
            "could not read --text /nonexistent.txt",
        ),
        (
            &[
                "model",
                "quantize",
                not_gguf,
                "out.gguf",
                "--target-bpw",
                "40",
                "--calibration",
                not_gguf,
            ],
            "give bits per weight between 0 and 32",
        ),
        (
            &[
                "model",
                "quantize",
                not_gguf,
                "out.gguf",
                "--target-size",
                "8XB",
                "--calibration",
                not_gguf,
            ],
            "unknown unit `xb`",
        ),
        (
            &[
                "eval",
                "--env",
                "echo",
                "--model",
                not_gguf,
                "--options",
                "[1]",
            ],
            "--options must be a JSON object",
        ),
        (
            &[
                "eval",
                "--env",
                "echo",
                "--model",
                not_gguf,
                "--overflow",
                "x",
            ],
            "unknown overflow policy",
        ),
        (
            &[
                "eval",
                "--env",
                "echo",
                "--model",
                not_gguf,
                "--profile",
                "/nonexistent.json",
            ],
            "could not read the profile /nonexistent.json",
        ),
        (
            &["eval", "--env", "echo", "--model", not_gguf],
            "not a readable GGUF file",
        ),
    ];
    assert_user_errors(&cases);
}

/// A server that cannot be reached is not the user's error (exit 2, as `env
/// validate` and the hub commands already said); and each cause of the failure
/// prints once. The episode's message repeated its model error, which repeated the
/// HTTP error, so the cause printed three times.
#[test]
fn an_unreachable_server_exits_2_and_each_cause_prints_once() {
    let cases: [&[&str]; 2] = [
        &[
            "eval",
            "--env",
            "echo",
            "--model",
            "http://127.0.0.1:9/v1",
            "--model-name",
            "x",
            "--episodes",
            "1",
            "-q",
        ],
        &["env", "run", "http://127.0.0.1:9", "-n", "1"],
    ];
    for args in cases {
        let out = agentstack(args);
        assert_eq!(out.code, 2, "{args:?}\n{}", snapshot(&out));
        assert!(
            out.stderr.contains("Connection refused"),
            "{args:?}\n{}",
            out.stderr
        );
        let lines: Vec<&str> = out
            .stderr
            .lines()
            .filter(|l| l.starts_with("error: ") || l.starts_with("  caused by: "))
            .map(|l| {
                l.trim_start_matches("error: ")
                    .trim_start_matches("  caused by: ")
            })
            .collect();
        for pair in lines.windows(2) {
            assert!(
                !pair[0].contains(pair[1]),
                "{args:?}: `{}` is printed twice\n{}",
                pair[1],
                out.stderr
            );
        }
    }
}

#[test]
fn help_documents_the_exit_codes() {
    let out = agentstack(&["--help"]);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    assert!(out.stdout.contains("Exit status:"), "{}", out.stdout);
    assert!(
        out.stdout.contains("  2  not the user's error"),
        "{}",
        out.stdout
    );
}
