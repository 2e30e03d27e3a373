//! `env serve` with API keys, driven by the real binary: `env run` and `env validate`
//! send the first key of `AGENTSTACK_API_KEY`, a 401 says to set it, and no key shows
//! in any log, even at the most verbose level. (`eval --env URL` and `train` open their
//! environment through the harness, whose own test covers the key.)

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agentstack_test_support::processes::run_bounded;

use super::{Output, snapshot};

/// The server's keys, as `AGENTSTACK_API_KEY` holds them.
const SERVER_KEYS: &str = "cli-first-key-3141,cli-second-key-2718";
/// Each key alone, to look for in logs.
const KEYS: [&str; 2] = ["cli-first-key-3141", "cli-second-key-2718"];
/// The most one client command here may take.
const LIMIT: Duration = Duration::from_secs(120);

/// The binary with a clean environment for keys and logs at `log`.
fn command(log: &str) -> Command {
    let mut command = Command::new(super::bin());
    command
        .env_remove("AGENTSTACK_API_KEY")
        .env("AGENTSTACK_LOG", log)
        .env("NO_COLOR", "1");
    command
}

/// Runs a client with `AGENTSTACK_API_KEY` set to `key` (none: unset).
fn client(args: &[&str], key: Option<&str>) -> Output {
    let home = tempfile::tempdir().unwrap();
    let mut command = command("trace");
    command
        .args(args)
        .env("HOME", home.path())
        .env("AGENTSTACK_HOME", home.path().join("data"));
    if let Some(key) = key {
        command.env("AGENTSTACK_API_KEY", key);
    }
    run_bounded(command, LIMIT).into()
}

fn read_all(mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = from.read_to_string(&mut text);
        text
    })
}

/// `env serve echo` with the keys from `AGENTSTACK_API_KEY`, logging everything.
struct Served {
    child: Child,
    url: String,
    log: std::thread::JoinHandle<String>,
}

impl Served {
    fn start() -> Self {
        let mut child = command("trace")
            .args(["env", "serve", "echo", "--port", "0"])
            .env("AGENTSTACK_API_KEY", SERVER_KEYS)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = read_all(child.stderr.take().unwrap());
        let url = super::listening_url(&mut child);
        Self { child, url, log }
    }

    /// Stops the server and returns everything it logged.
    fn stop(mut self) -> String {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let _ = self.child.wait();
        self.log.join().unwrap()
    }
}

fn assert_no_key(text: &str, what: &str) {
    for key in KEYS {
        assert!(!text.contains(key), "{what} shows a key:\n{text}");
    }
}

/// Regression: `env serve` took no key, and its clients had none to send. A client
/// without `AGENTSTACK_API_KEY` is refused with a hint to set it; with it (the first
/// key of a list), `env run` and `env validate` work.
#[test]
fn env_clients_send_the_key_the_server_asks_for() {
    let served = Served::start();
    let echo = format!("{}/echo", served.url);
    let with_key = Some("cli-second-key-2718,not-sent");

    for (args, wrong) in [
        (vec!["env", "run", &echo, "-n", "1"], None),
        (vec!["env", "validate", &echo], None),
        (vec!["env", "validate", &echo], Some("a-wrong-key")),
    ] {
        let out = client(&args, wrong);
        assert_eq!(out.code, 1, "{args:?}\n{}", snapshot(&out));
        assert!(
            out.stderr.contains("401") && out.stderr.contains("hint: set AGENTSTACK_API_KEY"),
            "{args:?}\n{}",
            snapshot(&out)
        );
        assert_no_key(&out.stderr, "a refused client's log");
    }

    let run = client(&["env", "run", &echo, "-n", "2", "--json"], with_key);
    assert_eq!(run.code, 0, "{}", snapshot(&run));
    assert_eq!(run.stdout.lines().count(), 2, "{}", snapshot(&run));
    let validate = client(&["env", "validate", &echo], with_key);
    assert_eq!(validate.code, 0, "{}", snapshot(&validate));
    for out in [&run, &validate] {
        assert_no_key(&out.stdout, "a client's output");
        assert_no_key(&out.stderr, "a client's log");
    }

    let log = served.stop();
    assert!(
        log.contains("API key"),
        "the server says it asks for keys:\n{log}"
    );
    assert_no_key(&log, "the server's log");
}
