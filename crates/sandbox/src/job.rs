//! What a run asks for and what it returns: plain data, validated, no I/O.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The largest single file a job may carry into the sandbox.
pub const MAX_JOB_FILE_BYTES: u64 = 64 << 20;
/// The most files a job may carry.
pub const MAX_JOB_FILES: usize = 4096;
/// The most arguments a command may have.
pub const MAX_ARGS: usize = 4096;

/// Resource limits of one run. Every limit applies to the whole process tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Wall-clock time from exec to the end of the run.
    #[serde(with = "millis")]
    pub wall: Duration,
    /// CPU time (user + system) of each process (`RLIMIT_CPU`).
    #[serde(with = "millis")]
    pub cpu: Duration,
    /// Address space of each process in bytes (`RLIMIT_AS`).
    pub memory_bytes: u64,
    /// Processes and threads the sandbox's user may have at once (`RLIMIT_NPROC`).
    pub processes: u64,
    /// Largest file a process may write, in bytes (`RLIMIT_FSIZE`).
    pub file_bytes: u64,
    /// Bytes kept of stdout and of stderr each; a run that writes more is stopped.
    pub output_bytes: u64,
    /// Size of the writable scratch directory (`/work`, a tmpfs), in bytes.
    pub scratch_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            wall: Duration::from_secs(10),
            cpu: Duration::from_secs(10),
            memory_bytes: 512 << 20,
            processes: 64,
            file_bytes: 16 << 20,
            output_bytes: 1 << 20,
            scratch_bytes: 64 << 20,
        }
    }
}

impl Limits {
    /// Checks that every limit is usable; the message says which one is not and why.
    pub fn validate(&self) -> Result<(), String> {
        let checks: [(bool, &str); 7] = [
            (
                self.wall >= Duration::from_millis(1)
                    && self.wall <= Duration::from_secs(24 * 3600),
                "wall time must be between 1 ms and 24 h",
            ),
            (
                self.cpu >= Duration::from_secs(1) && self.cpu <= Duration::from_secs(24 * 3600),
                "CPU time must be between 1 s and 24 h (the kernel counts it in whole seconds)",
            ),
            (
                self.memory_bytes >= 16 << 20,
                "memory must be at least 16 MiB (an interpreter needs that much address space to start)",
            ),
            (
                (1..=1 << 16).contains(&self.processes),
                "processes must be between 1 and 65536",
            ),
            (
                self.file_bytes >= 1,
                "file size limit must be at least 1 byte",
            ),
            (
                (1..=1 << 30).contains(&self.output_bytes),
                "output limit must be between 1 byte and 1 GiB",
            ),
            (
                self.scratch_bytes >= 1 << 20,
                "scratch size must be at least 1 MiB",
            ),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, message)) => Err((*message).to_owned()),
            None => Ok(()),
        }
    }
}

/// A file placed in the scratch directory before the command starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFile {
    /// Path relative to the scratch directory (`/work`), `/`-separated, no `..`.
    pub path: String,
    /// Contents.
    pub contents: Vec<u8>,
    /// Whether the file is executable (mode 0755 instead of 0644).
    pub executable: bool,
}

impl JobFile {
    /// A regular, non-executable file.
    pub fn new(path: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        Self {
            path: path.into(),
            contents: contents.into(),
            executable: false,
        }
    }
}

/// One command to run in a fresh sandbox.
#[derive(Debug, Clone, Default)]
pub struct Job {
    /// The command and its arguments; a bare program name is looked up on the
    /// sandbox's `PATH` (`/usr/local/bin:/usr/bin:/bin`).
    pub argv: Vec<String>,
    /// Files written into the scratch directory first.
    pub files: Vec<JobFile>,
    /// Bytes fed to the command's stdin (then closed).
    pub stdin: Vec<u8>,
    /// Environment variables added to the sandbox's minimal environment (`PATH`,
    /// `HOME=/work`, `TMPDIR=/tmp`, `LANG=C.UTF-8`). Nothing of the host's environment
    /// is passed on.
    pub env: Vec<(String, String)>,
    /// Limits; the sandbox's defaults when not set.
    pub limits: Limits,
}

impl Job {
    /// A job running `argv` with default limits.
    pub fn new<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        Self {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    /// Checks the job before anything starts; the message says what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        let Some(program) = self.argv.first() else {
            return Err("the command is empty: give a program to run".into());
        };
        if program.is_empty() {
            return Err("the program name is empty".into());
        }
        if self.argv.len() > MAX_ARGS {
            return Err(format!("at most {MAX_ARGS} arguments are allowed"));
        }
        if let Some(arg) = self.argv.iter().find(|a| a.contains('\0')) {
            return Err(format!("argument {arg:?} contains a NUL byte"));
        }
        for (key, value) in &self.env {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return Err(format!(
                    "environment variable {key:?} is invalid: names must be non-empty without '=' or NUL, values without NUL"
                ));
            }
        }
        self.limits.validate()?;
        if self.files.len() > MAX_JOB_FILES {
            return Err(format!("at most {MAX_JOB_FILES} files are allowed"));
        }
        let mut total = 0u64;
        for file in &self.files {
            check_relative_path(&file.path)?;
            let len = file.contents.len() as u64;
            if len > MAX_JOB_FILE_BYTES {
                return Err(format!(
                    "file {:?} is {len} bytes; the most a job may carry is {MAX_JOB_FILE_BYTES}",
                    file.path
                ));
            }
            total += len;
        }
        if total > self.limits.scratch_bytes {
            return Err(format!(
                "the job's files total {total} bytes, more than the scratch directory's {} bytes; raise the scratch size",
                self.limits.scratch_bytes
            ));
        }
        Ok(())
    }
}

/// Checks a path given relative to the scratch directory.
pub fn check_relative_path(path: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("file path {path:?} {why}"));
    if path.is_empty() {
        return bad("is empty");
    }
    if path.starts_with('/') {
        return bad("is absolute; give it relative to the scratch directory");
    }
    if path.contains('\0') {
        return bad("contains a NUL byte");
    }
    if path.len() > 1024 {
        return bad("is longer than 1024 bytes");
    }
    for part in path.split('/') {
        match part {
            "" => return bad("has an empty component (`//` or a trailing `/`)"),
            "." | ".." => return bad("may not contain `.` or `..` components"),
            _ => {}
        }
    }
    Ok(())
}

/// Which limit ended a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitKind {
    /// Wall-clock time.
    WallTime,
    /// CPU time.
    CpuTime,
    /// Output (stdout or stderr) over its cap.
    Output,
    /// A file over the size limit.
    FileSize,
}

impl LimitKind {
    /// A short name for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Self::WallTime => "wall-time limit",
            Self::CpuTime => "CPU-time limit",
            Self::Output => "output limit",
            Self::FileSize => "file-size limit",
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum End {
    /// The command exited with this status.
    Exited {
        /// Exit status.
        code: i32,
    },
    /// The command was killed by a signal that no limit explains.
    Signaled {
        /// Signal number.
        signal: i32,
    },
    /// A limit stopped the command.
    Limit {
        /// Which one.
        limit: LimitKind,
    },
    /// The program could not be started (not found, not executable).
    NotStarted,
}

impl End {
    /// Whether the command exited with status 0.
    pub fn success(self) -> bool {
        self == Self::Exited { code: 0 }
    }

    /// A shell-style exit code: the status, 128 + signal, or 124 for a limit (as
    /// `timeout(1)`), 127 when the program could not be started.
    pub fn shell_code(self) -> i32 {
        match self {
            Self::Exited { code } => code,
            Self::Signaled { signal } => 128 + signal,
            Self::Limit { .. } => 124,
            Self::NotStarted => 127,
        }
    }
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited { code } => write!(f, "exited with status {code}"),
            Self::Signaled { signal } => write!(f, "was killed by signal {signal}"),
            Self::Limit { limit } => write!(f, "was stopped by the {}", limit.describe()),
            Self::NotStarted => write!(f, "could not be started"),
        }
    }
}

/// Resources a run used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Wall-clock time from fork to the end of the run.
    #[serde(with = "millis_f")]
    pub wall: Duration,
    /// User CPU time of the process tree.
    #[serde(with = "millis_f")]
    pub cpu_user: Duration,
    /// System CPU time of the process tree.
    #[serde(with = "millis_f")]
    pub cpu_system: Duration,
    /// Peak resident set size of the largest process, in bytes.
    pub max_rss_bytes: u64,
}

/// What a run returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// How it ended.
    pub end: End,
    /// Standard output, at most the output limit.
    pub stdout: Vec<u8>,
    /// Standard error, at most the output limit.
    pub stderr: Vec<u8>,
    /// Whether stdout was cut at the limit.
    pub stdout_truncated: bool,
    /// Whether stderr was cut at the limit.
    pub stderr_truncated: bool,
    /// Resources used.
    pub usage: Usage,
}

impl Outcome {
    /// Standard output as text (invalid UTF-8 replaced).
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Standard error as text (invalid UTF-8 replaced).
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

mod millis_f {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1e3)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let ms = f64::deserialize(d)?;
        Ok(Duration::from_secs_f64(ms.max(0.0) / 1e3))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_inside_scratch() {
        for good in ["a.py", "src/pkg/mod.py", ".hidden", "a..b"] {
            assert!(check_relative_path(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "a/",
            "./a",
            "a\0b",
        ] {
            assert!(check_relative_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn jobs_are_checked_before_they_run() {
        assert!(Job::new(["python3", "-c", "print(1)"]).validate().is_ok());
        let empty: [&str; 0] = [];
        assert!(Job::new(empty).validate().unwrap_err().contains("empty"));
        let mut job = Job::new(["sh"]);
        job.limits.memory_bytes = 1;
        assert!(job.validate().unwrap_err().contains("memory"));
        let mut job = Job::new(["sh"]);
        job.env.push(("A=B".into(), "x".into()));
        assert!(job.validate().unwrap_err().contains("environment"));
        let mut job = Job::new(["sh"]);
        job.limits.scratch_bytes = 1 << 20;
        job.files.push(JobFile::new("big", vec![0u8; 2 << 20]));
        assert!(job.validate().unwrap_err().contains("scratch"));
    }

    #[test]
    fn ends_have_shell_codes() {
        assert_eq!(End::Exited { code: 3 }.shell_code(), 3);
        assert_eq!(End::Signaled { signal: 9 }.shell_code(), 137);
        assert_eq!(
            End::Limit {
                limit: LimitKind::WallTime
            }
            .shell_code(),
            124
        );
        assert!(End::Exited { code: 0 }.success());
    }
}
