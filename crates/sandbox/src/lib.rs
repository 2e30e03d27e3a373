//! Runs untrusted commands isolated: a fresh set of Linux namespaces per run (user,
//! mount, PID, network with only loopback, IPC, UTS, cgroup), a read-only root with one
//! writable, size-limited scratch directory, an unprivileged uid, `no_new_privs`, a
//! system-call filter, and rlimits on CPU time, address space, processes, file size;
//! wall time and output are bounded by the supervisor. Nothing is left behind: the PID
//! namespace's end kills every process the command started, and the scratch tmpfs dies
//! with its mount namespace.
//!
//! The system-call filter (seccomp-bpf, installed last before the command starts and
//! inherited by everything it starts) refuses with `EPERM`: new namespaces (`unshare`,
//! `setns`, `clone` with a `CLONE_NEW*` flag), io_uring, the kernel keyring, `bpf`,
//! `perf_event_open`, `userfaultfd`, every way to mount, `ptrace` and reading or writing
//! other processes' memory, opening files by handle (`open_by_handle_at`), kernel
//! modules, `kexec`, swap, reboot, setting the clock, accounting, quotas, the kernel
//! log, and `personality` changes; `clone3` fails with `ENOSYS` so the C library uses
//! `clone`, whose flags the filter can see. A system call through a foreign ABI (i386's
//! `int 0x80` or x32 on x86_64) kills the process. Threads, `fork`, subprocesses and
//! Python's `multiprocessing` work as usual.
//!
//! Nothing of the host shows inside: the sandbox's pid 1 is named `sandbox-init` (its
//! command line, name and empty environment are all a command can read of it), and the
//! program exposed with [`SandboxConfig::expose_program`] is bound from a link in a
//! private temporary directory, so `/proc/self/mountinfo` does not show its host path.
//!
//! A [`Sandbox`] keeps a pool of sandboxes already isolated and waiting, so a run starts
//! in milliseconds; it runs at most `max_concurrent` at once and queues the rest.
//!
//! ```no_run
//! # async fn demo() -> Result<(), agentstack_sandbox::Error> {
//! use agentstack_sandbox::{Job, JobFile, Sandbox, SandboxConfig};
//!
//! let sandbox = Sandbox::start(SandboxConfig::default()).await?;
//! let mut job = Job::new(["python3", "main.py"]);
//! job.files.push(JobFile::new("main.py", "print(6 * 7)"));
//! let outcome = sandbox.run(&job).await?;
//! assert_eq!(outcome.stdout_text(), "42\n");
//! # Ok(()) }
//! ```
//!
//! The sandbox's init process is the host's own executable, started again with a
//! special first argument; a binary that uses this crate calls [`run_if_init`] first
//! thing in `main`.

pub mod job;
mod pool;
pub mod wire;

#[cfg(target_os = "linux")]
mod init;
#[cfg(target_os = "linux")]
mod seccomp;

pub use job::{End, Job, JobFile, LimitKind, Limits, Outcome, Usage};
pub use pool::{Error, INIT_PROGRAM_ENV, Sandbox, SandboxConfig};
pub use wire::Isolation;

/// Where [`SandboxConfig::expose_program`] puts the init program inside a sandbox.
pub const PROGRAM_IN_SANDBOX: &str = "/opt/agentstack/bin/agentstack";

#[cfg(target_os = "linux")]
pub use init::{SANDBOX_ID, SCRATCH, run_if_init};

/// If this process was started as a sandbox init, runs it and exits; otherwise returns.
/// Sandboxes need Linux; elsewhere this does nothing.
#[cfg(not(target_os = "linux"))]
pub fn run_if_init() {}
