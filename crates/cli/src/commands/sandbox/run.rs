//! `agentstack sandbox run [LIMITS] -- COMMAND...`: one command in a fresh sandbox.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use agentstack_sandbox::{Job, JobFile, Limits, Sandbox};
use anyhow::{Context, anyhow, bail};

use crate::Exit;
use crate::args::SandboxRunArgs;

/// Runs the command and exits with its status.
pub async fn run(args: SandboxRunArgs) -> Result<(), Exit> {
    // Everything `job` reads is the user's: flags, --files, stdin.
    let job = job(&args).map_err(Exit::user)?;
    if args.unsafe_no_isolation {
        eprintln!(
            "warning: --unsafe-no-isolation: the command runs as a plain process and sees this machine's files and network"
        );
    }
    let sandbox = Sandbox::start(super::config(
        args.unsafe_no_isolation,
        args.read_only.clone(),
    ))
    .await
    .map_err(|e| Exit::user(anyhow!(e)))?;
    let outcome = sandbox
        .run(&job)
        .await
        .map_err(|e| Exit::user(anyhow!(e)))?;
    if args.json {
        let value = serde_json::json!({
            "end": outcome.end,
            "stdout": outcome.stdout_text(),
            "stderr": outcome.stderr_text(),
            "stdout_truncated": outcome.stdout_truncated,
            "stderr_truncated": outcome.stderr_truncated,
            "usage": outcome.usage,
        });
        println!("{value}");
    } else {
        std::io::stdout()
            .write_all(&outcome.stdout)
            .and_then(|()| std::io::stdout().flush())
            .context("writing the command's output")?;
        let _ = std::io::stderr().write_all(&outcome.stderr);
        if !outcome.end.success() || outcome.stdout_truncated || outcome.stderr_truncated {
            let usage = &outcome.usage;
            eprintln!(
                "sandbox: the command {}{} (wall {:.0} ms, cpu {:.0} ms, max rss {} KiB)",
                outcome.end,
                if outcome.stdout_truncated || outcome.stderr_truncated {
                    "; output was cut at the limit"
                } else {
                    ""
                },
                usage.wall.as_secs_f64() * 1e3,
                (usage.cpu_user + usage.cpu_system).as_secs_f64() * 1e3,
                usage.max_rss_bytes / 1024,
            );
        }
    }
    match outcome.end.shell_code() {
        0 => Ok(()),
        code => Err(Exit::quiet(u8::try_from(code.clamp(1, 255)).unwrap_or(1))),
    }
}

fn job(args: &SandboxRunArgs) -> anyhow::Result<Job> {
    if !(args.time.is_finite() && args.time > 0.0) {
        bail!("--time must be a positive number of seconds");
    }
    let wall = Duration::from_secs_f64(args.time);
    let limits = Limits {
        wall,
        cpu: Duration::from_secs(args.cpu.unwrap_or_else(|| args.time.ceil() as u64).max(1)),
        memory_bytes: args.memory,
        processes: args.processes,
        file_bytes: args.file_size,
        output_bytes: args.output,
        scratch_bytes: args.scratch,
    };
    let mut job = Job::new(args.command.iter().cloned());
    job.limits = limits;
    for pair in &args.env {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| anyhow!("--env {pair:?} must be KEY=VALUE"))?;
        job.env.push((key.to_owned(), value.to_owned()));
    }
    if let Some(dir) = &args.files {
        collect_files(dir, dir, &mut job.files)
            .with_context(|| format!("reading --files {}", dir.display()))?;
    }
    if args.stdin {
        std::io::stdin()
            .take(64 << 20)
            .read_to_end(&mut job.stdin)
            .context("reading stdin")?;
    }
    job.validate().map_err(|e| anyhow!(e))?;
    Ok(job)
}

/// Every regular file under `dir`, relative to `root`; symbolic links are refused so
/// that nothing outside the directory is copied in by accident.
fn collect_files(root: &Path, dir: &Path, out: &mut Vec<JobFile>) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut entries = std::fs::read_dir(dir)?.collect::<Result<Vec<_>, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.is_dir() {
            collect_files(root, &path, out)?;
        } else if meta.is_file() {
            let relative = path
                .strip_prefix(root)?
                .to_str()
                .ok_or_else(|| anyhow!("{} is not valid UTF-8", path.display()))?
                .to_owned();
            out.push(JobFile {
                path: relative,
                contents: std::fs::read(&path)?,
                executable: meta.permissions().mode() & 0o111 != 0,
            });
        } else {
            bail!(
                "{} is not a regular file or directory (links are not copied)",
                path.display()
            );
        }
    }
    Ok(())
}
