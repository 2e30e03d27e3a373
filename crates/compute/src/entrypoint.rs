//! The shell script each node of a component runs, on every backend: it waits for the
//! peers' addresses when they come from a file, links the file mounts, enters the
//! workdir, runs `setup`, then `exec`s `run`.
//!
//! The `exec` is what makes stopping work the same everywhere: after it, the process
//! the engine started *is* the `run` command, so the signal the engine sends to stop a
//! job (`scancel --signal=TERM`, `POST /api/jobs/{id}/stop`, a Pod's deletion, which all
//! send SIGTERM first and SIGKILL after a grace period) reaches the program once, and
//! a trainer can checkpoint and exit. `bash -c` runs a single command in place, so
//! `run: python train.py` is the program itself; a `run` of several lines should start
//! its program with `exec` for the same effect on Kubernetes, where only the
//! container's first process is signalled.

use crate::request::{shell_path, shell_quote};
use crate::spec::Task;

/// How the script finds its surroundings on a backend.
#[derive(Debug, Clone, Default)]
pub struct EntrypointOptions<'a> {
    /// Where the task's `workdir` is on the node; no `cd` when `None`.
    pub workdir: Option<&'a str>,
    /// A file of `export NAME=value` lines (see [`crate::discovery::env_file`]) that the
    /// launcher writes once every component is placed; the script waits for it, then
    /// reads it.
    pub discovery_file: Option<&'a str>,
    /// Seconds to wait for the discovery file before failing.
    pub discovery_timeout_seconds: u64,
    /// A variable that holds the node's rank at run time (`SLURM_NODEID`), exported as
    /// `SKYPILOT_NODE_RANK`.
    pub rank_from: Option<&'a str>,
}

/// Exit code of a node whose discovery file never came: 75, `EX_TEMPFAIL`, so a
/// recovery policy can tell it from the program's own failures.
pub const DISCOVERY_TIMEOUT_EXIT_CODE: u8 = 75;

/// The script, for `bash -c`.
pub fn script(task: &Task, options: &EntrypointOptions<'_>) -> String {
    let mut s = String::new();
    let mut line = |text: &str| {
        s.push_str(text);
        s.push('\n');
    };
    if let Some(var) = options.rank_from {
        line(&format!(
            "export {}=\"${var}\"",
            crate::discovery::SKYPILOT_NODE_RANK
        ));
    }
    if let Some(file) = options.discovery_file {
        let file = shell_path(file);
        let timeout = options.discovery_timeout_seconds;
        line(&format!("deadline=$((SECONDS + {timeout}))"));
        line(&format!("until [ -e {file} ]; do"));
        line("  if [ \"$SECONDS\" -ge \"$deadline\" ]; then");
        line(&format!(
            "    echo \"agentstack: no peer addresses after {timeout}s in\" {file} >&2"
        ));
        line(&format!("    exit {DISCOVERY_TIMEOUT_EXIT_CODE}"));
        line("  fi");
        line("  sleep 0.2");
        line("done");
        line(&format!(". {file}"));
    }
    for (target, source) in &task.file_mounts {
        let target = shell_path(target);
        line(&format!(
            "mkdir -p -- \"$(dirname -- {target})\" && ln -sfn -- {} {target} || exit 1",
            shell_path(source)
        ));
    }
    if let Some(dir) = options.workdir {
        line(&format!("cd -- {} || exit 1", shell_path(dir)));
    }
    if let Some(setup) = &task.setup {
        line(&format!("bash -c {} || {{", shell_quote(setup)));
        line("  status=$?");
        line(&format!(
            "  echo \"agentstack: setup of {} failed with exit code $status\" >&2",
            task.name
        ));
        line("  exit \"$status\"");
        line("}");
    }
    line(&format!("exec bash -c {}", shell_quote(&task.run)));
    s
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    use super::*;
    use crate::spec::JobGroup;

    fn task(yaml: &str) -> Task {
        JobGroup::parse(yaml).unwrap().components.remove(0)
    }

    fn run_script(script: &str) -> (i32, String, String) {
        let out = Command::new("bash").arg("-c").arg(script).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn setup_then_run_in_the_workdir() {
        let dir = std::env::temp_dir().join(format!("agentstack-entry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = task("name: t\nsetup: echo \"it's set up\"\nrun: |\n  pwd\n  echo \"ran $X\"\n");
        let in_dir = script(
            &t,
            &EntrypointOptions {
                workdir: Some(dir.to_str().unwrap()),
                ..Default::default()
            },
        );
        let (code, stdout, _) = run_script(&format!("export X=1\n{in_dir}"));
        assert_eq!(code, 0);
        let canonical = dir.canonicalize().unwrap();
        assert_eq!(
            stdout,
            format!("it's set up\n{}\nran 1\n", canonical.display())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn failed_setup_stops_before_run_with_its_code() {
        let t = task("name: t\nsetup: exit 3\nrun: echo never\n");
        let (code, stdout, stderr) = run_script(&script(&t, &EntrypointOptions::default()));
        assert_eq!(code, 3);
        assert_eq!(stdout, "");
        assert!(
            stderr.contains("setup of t failed with exit code 3"),
            "{stderr}"
        );
    }

    #[test]
    fn discovery_file_is_awaited_and_read() {
        let dir = std::env::temp_dir().join(format!("agentstack-disc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("peers.env");
        let t = task("name: t\nrun: echo \"$AGENTSTACK_T_ADDRS\"\n");
        let waiting = script(
            &t,
            &EntrypointOptions {
                discovery_file: Some(file.to_str().unwrap()),
                discovery_timeout_seconds: 20,
                ..Default::default()
            },
        );
        let writer = {
            let file = file.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(300));
                let vars = [("AGENTSTACK_T_ADDRS".to_owned(), "h:1,it's:2".to_owned())].into();
                std::fs::write(file, crate::discovery::env_file(&vars)).unwrap();
            })
        };
        let (code, stdout, _) = run_script(&waiting);
        writer.join().unwrap();
        assert_eq!((code, stdout.as_str()), (0, "h:1,it's:2\n"));

        std::fs::remove_file(&file).unwrap();
        let t = task("name: t\nrun: echo never\n");
        let gives_up = script(
            &t,
            &EntrypointOptions {
                discovery_file: Some(file.to_str().unwrap()),
                discovery_timeout_seconds: 0,
                ..Default::default()
            },
        );
        let (code, _, stderr) = run_script(&gives_up);
        assert_eq!(code, i32::from(DISCOVERY_TIMEOUT_EXIT_CODE), "{stderr}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The engines stop a job by signalling the process they started; after `exec` that
    /// process is the program, so its handler runs (here: "checkpoint", exit 7).
    #[test]
    fn a_stop_signal_reaches_the_program() {
        let t = task(
            "name: t\nsetup: 'true'\nrun: |\n  trap 'echo checkpointed; kill $!; exit 7' TERM\n  echo ready\n  sleep 30 & wait\n",
        );
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(script(&t, &EntrypointOptions::default()))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        assert_eq!(first, "ready\n");
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let mut rest = String::new();
        stdout.read_line(&mut rest).unwrap();
        assert_eq!(rest, "checkpointed\n");
        assert_eq!(child.wait().unwrap().code(), Some(7));
    }

    #[test]
    fn file_mounts_are_linked() {
        let dir = std::env::temp_dir().join(format!("agentstack-mount-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(dir.join("src/a.txt"), "data").unwrap();
        let yaml = format!(
            "name: t\nfile_mounts: {{{}/mnt/data: {}/src}}\nrun: cat {}/mnt/data/a.txt\n",
            dir.display(),
            dir.display(),
            dir.display()
        );
        let (code, stdout, stderr) =
            run_script(&script(&task(&yaml), &EntrypointOptions::default()));
        assert_eq!((code, stdout.as_str()), (0, "data"), "{stderr}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
