//! `--show-settings` (hidden) of `train`, `eval` and `launch`: what each command resolves
//! from its flags, environment variables and files, without doing the work. The
//! temporary home's path is redacted as `[HOME]`.

use std::path::Path;

use agentstack_test_support::cli::{Output, command_in, snapshot};

/// Every variable these commands' settings read: removed, so the developer's shell does
/// not leak into the snapshots, then set per test.
const SETTINGS_VARS: &[&str] = &[
    "AGENTSTACK_PYTHON",
    "AGENTSTACK_RAY_ADDRESS",
    "AGENTSTACK_K8S_IMAGE",
    "AGENTSTACK_K8S_NAMESPACE",
    "AGENTSTACK_LOCAL_CPUS",
];

/// Runs `args` in `home` with exactly the settings variables `vars`, and returns the
/// snapshot text with the home redacted.
fn show_settings(home: &Path, args: &[&str], vars: &[(&str, &str)]) -> String {
    let mut command = command_in(home);
    for name in SETTINGS_VARS {
        command.env_remove(name);
    }
    command.envs(vars.iter().copied());
    command.args(args).arg("--show-settings");
    let out = Output::of(&mut command);
    assert_eq!(out.code, 0, "{}", snapshot(&out));
    let home = home.to_str().expect("a Unicode temporary path");
    snapshot(&out).replace(home, "[HOME]")
}

#[test]
fn train_shows_the_config_with_the_flags_applied() {
    let home = tempfile::tempdir().unwrap();
    let config = home.path().join("arith.toml");
    std::fs::write(
        &config,
        "model = \"model.gguf\"\nenv = \"arithmetic\"\nsteps = 80\n[env_options]\ndifficulty = 1\n",
    )
    .unwrap();
    insta::assert_snapshot!(show_settings(
        home.path(),
        &[
            "train",
            "grpo",
            "--config",
            config.to_str().unwrap(),
            "--steps",
            "3",
            "--sync-server",
            "http://127.0.0.1:9",
            // A job group's address list: comma-separated, `http://` added.
            "--rollout-server",
            "127.0.0.1:10,http://127.0.0.1:11",
        ],
        // Empty is unset: python3.
        &[("AGENTSTACK_PYTHON", "")],
    ));
}

#[test]
fn eval_shows_its_checked_flags() {
    let home = tempfile::tempdir().unwrap();
    insta::assert_snapshot!(show_settings(
        home.path(),
        &[
            "eval",
            "--env",
            "arithmetic",
            "--model",
            "model.gguf",
            "--episodes",
            "5",
            "--context-tokens",
            "1024",
            "--overflow",
            "truncate",
            "--options",
            "{\"difficulty\": 2}",
        ],
        &[("AGENTSTACK_PYTHON", "/opt/python3")],
    ));
}

#[test]
fn launch_shows_the_infra_and_the_backend_options() {
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join("job.yaml");
    std::fs::write(
        &file,
        "name: demo\nexecution: parallel\n---\nname: server\nrun: sleep 1\nresources: {infra: ray}\n---\nname: client\nrun: echo hi\n",
    )
    .unwrap();
    insta::assert_snapshot!(show_settings(
        home.path(),
        &["launch", file.to_str().unwrap(), "--k8s-queue", "team"],
        &[
            ("AGENTSTACK_RAY_ADDRESS", "http://127.0.0.1:8266"),
            // Empty is unset: the context's namespace, else default.
            ("AGENTSTACK_K8S_NAMESPACE", ""),
            ("AGENTSTACK_LOCAL_CPUS", "6"),
        ],
    ));
}

/// Regression: `launch` took an empty `AGENTSTACK_RAY_ADDRESS`, `AGENTSTACK_K8S_IMAGE` or
/// `AGENTSTACK_K8S_NAMESPACE` for a value and refused an empty `AGENTSTACK_LOCAL_CPUS`;
/// an empty variable is unset, as everywhere else.
#[test]
fn an_empty_variable_is_unset() {
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join("job.yaml");
    std::fs::write(&file, "name: t\nrun: echo hi\n").unwrap();
    let empty = [
        ("AGENTSTACK_RAY_ADDRESS", ""),
        ("AGENTSTACK_K8S_IMAGE", ""),
        ("AGENTSTACK_K8S_NAMESPACE", ""),
        ("AGENTSTACK_LOCAL_CPUS", ""),
    ];
    let shown = show_settings(home.path(), &["launch", file.to_str().unwrap()], &empty);
    for field in ["ray_address", "k8s_image", "k8s_namespace", "local_cpus"] {
        assert!(
            shown.contains(&format!("{field}: None,")),
            "{field}\n{shown}"
        );
    }
}
