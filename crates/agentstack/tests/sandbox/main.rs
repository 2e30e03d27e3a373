//! The sandbox's security suite: from inside a sandbox, try to reach the host's
//! loopback, see a way out of the network namespace, read and write host files,
//! exhaust processes, memory, CPU and disk, signal or trace a host process, leave a
//! process behind, gain privileges through a setuid binary, make the system calls the
//! filter refuses (io_uring, nested namespaces, the keyring, bpf, mounting, ptrace...),
//! and learn the host's paths or environment from pid 1 or the mount table. Every
//! attempt must fail, and each test also checks that the host was not affected; and
//! ordinary Python work (threads, subprocesses, a process pool) must still run.
//!
//! The sandbox's init process is the real `agentstack` binary. Nothing here sends
//! traffic anywhere but the host's own loopback (one test listens there and checks
//! that nothing arrives); routes and interfaces are only inspected.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use agentstack_sandbox::{End, Job, JobFile, LimitKind, Limits, Outcome, Sandbox, SandboxConfig};

fn config() -> SandboxConfig {
    SandboxConfig {
        program: Some(PathBuf::from(env!("CARGO_BIN_EXE_agentstack"))),
        warm: 0,
        ..SandboxConfig::default()
    }
}

async fn sandbox() -> Sandbox {
    Sandbox::start(config())
        .await
        .expect("this machine allows sandboxes")
}

/// Runs a Python program with `limits`.
async fn python(sandbox: &Sandbox, code: &str, limits: Limits) -> Outcome {
    let mut job = Job::new(["python3", "attack.py"]);
    job.files.push(JobFile::new("attack.py", code));
    job.limits = limits;
    let outcome = sandbox.run(&job).await.expect("the sandbox ran the job");
    eprintln!(
        "end: {}\nstdout: {}\nstderr: {}",
        outcome.end,
        outcome.stdout_text(),
        outcome.stderr_text()
    );
    outcome
}

fn short() -> Limits {
    Limits {
        wall: Duration::from_secs(5),
        cpu: Duration::from_secs(5),
        ..Limits::default()
    }
}

/// Processes on the host whose command line contains `marker`.
fn host_processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if text.contains(marker) {
                found.push(format!("{}: {text}", entry.file_name().to_string_lossy()));
            }
        }
    }
    found
}

fn host_still_works() {
    let status = Command::new("true")
        .status()
        .expect("the host can start processes");
    assert!(status.success());
}

#[tokio::test]
async fn a_plain_program_runs_and_returns_its_output() {
    let sandbox = sandbox().await;
    let outcome = python(
        &sandbox,
        "import os, sys\nprint(os.getuid(), os.getcwd(), sys.stdin.read())",
        short(),
    )
    .await;
    assert_eq!(outcome.end, End::Exited { code: 0 });
    assert_eq!(outcome.stdout_text(), "1000 /work \n");
    let mut job = Job::new(["cat"]);
    job.stdin = b"fed through stdin".to_vec();
    let outcome = sandbox.run(&job).await.unwrap();
    assert_eq!(outcome.stdout_text(), "fed through stdin");
    let outcome = sandbox.run(&Job::new(["no-such-program"])).await.unwrap();
    assert_eq!(outcome.end, End::NotStarted);
}

#[tokio::test]
async fn the_hosts_loopback_is_unreachable() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let sandbox = sandbox().await;
    let code = format!(
        r#"
import socket
for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect((host, {port}))
        print("CONNECTED", host)
    except OSError as e:
        print("refused", host, type(e).__name__)
"#
    );
    let outcome = python(&sandbox, &code, short()).await;
    assert!(outcome.end.success());
    let out = outcome.stdout_text();
    assert!(!out.contains("CONNECTED"), "{out}");
    assert_eq!(out.matches("refused").count(), 2, "{out}");
    // The host's listener saw nothing.
    assert!(
        listener.accept().is_err(),
        "a connection reached the host's listener"
    );
}

#[tokio::test]
async fn only_loopback_exists_and_there_is_no_route_out() {
    let sandbox = sandbox().await;
    let code = r#"
import socket
print("interfaces", sorted(name for _, name in socket.if_nameindex()))
routes = open("/proc/net/route").read().splitlines()[1:]
print("ipv4_routes", len(routes))
v6 = [line.split()[-1] for line in open("/proc/net/ipv6_route").read().splitlines()]
print("ipv6_route_devices", sorted(set(v6)))
"#;
    let outcome = python(&sandbox, code, short()).await;
    assert!(outcome.end.success());
    let out = outcome.stdout_text();
    assert!(out.contains("interfaces ['lo']"), "{out}");
    assert!(out.contains("ipv4_routes 0"), "{out}");
    assert!(
        out.contains("ipv6_route_devices []") || out.contains("ipv6_route_devices ['lo']"),
        "{out}"
    );
}

#[tokio::test]
async fn host_files_outside_the_allowed_set_are_invisible() {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let repo = env!("CARGO_MANIFEST_DIR");
    let sandbox = sandbox().await;
    let code = format!(
        r#"
import os
for path in ["/etc/shadow", "/etc/passwd-", {home:?}, {repo:?}, {repo:?} + "/Cargo.toml", "/root", "/home", "/var", "/run"]:
    try:
        if os.path.isdir(path):
            print("LISTED", path, os.listdir(path)[:3])
        else:
            print("READ", path, open(path, "rb").read(20))
    except OSError as e:
        print("denied", path, type(e).__name__)
"#
    );
    let outcome = python(&sandbox, &code, short()).await;
    assert!(outcome.end.success());
    let out = outcome.stdout_text();
    assert!(!out.contains("LISTED") && !out.contains("READ"), "{out}");
    assert_eq!(out.matches("denied").count(), 9, "{out}");
    // The host's files are where they were.
    assert!(Path::new(repo).join("Cargo.toml").is_file());
}

#[tokio::test]
async fn nothing_outside_scratch_is_writable() {
    let sandbox = sandbox().await;
    let repo = env!("CARGO_MANIFEST_DIR");
    let code = format!(
        r#"
import os
for path in ["/usr/escape", "/etc/escape", "/escape", "/dev/escape", "/proc/escape", "/bin/escape",
             "/proc/sys/kernel/hostname", {repo:?} + "/escape"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("WROTE", path)
    except OSError as e:
        print("denied", path, type(e).__name__)
with open("/work/ok", "w") as f:
    f.write("fine")
with open("/tmp/ok", "w") as f:
    f.write("fine")
print("scratch ok")
"#
    );
    let outcome = python(&sandbox, &code, short()).await;
    assert!(outcome.end.success());
    let out = outcome.stdout_text();
    assert!(!out.contains("WROTE"), "{out}");
    assert_eq!(out.matches("denied").count(), 8, "{out}");
    assert!(out.contains("scratch ok"));
    assert!(!Path::new(repo).join("escape").exists());
    assert!(!Path::new("/escape").exists());
}

#[tokio::test]
async fn a_fork_bomb_is_contained() {
    let sandbox = sandbox().await;
    let marker = format!("forkbomb-{}", std::process::id());
    let code = format!(
        r#"
import os, time, sys
sys.argv[0] = {marker:?}
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print("stopped after", n, type(e).__name__)
"#
    );
    let limits = Limits {
        processes: 32,
        ..short()
    };
    let outcome = python(&sandbox, &code, limits).await;
    let out = outcome.stdout_text();
    assert!(out.contains("stopped after"), "{out}");
    let forked: u64 = out.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert!(forked < 32, "{out}");
    // Its children died with the sandbox.
    std::thread::sleep(Duration::from_millis(200));
    assert!(host_processes_with("time.sleep(60)").is_empty());
    host_still_works();
}

#[tokio::test]
async fn allocating_10_gb_fails() {
    let sandbox = sandbox().await;
    let code = r#"
try:
    block = bytearray(10 * 1024**3)
    print("ALLOCATED", len(block))
except MemoryError:
    print("refused")
"#;
    let outcome = python(&sandbox, code, short()).await;
    assert_eq!(outcome.stdout_text().trim(), "refused");
    assert!(outcome.usage.max_rss_bytes < Limits::default().memory_bytes);
    host_still_works();
}

#[tokio::test]
async fn spinning_forever_is_stopped() {
    let sandbox = sandbox().await;
    let limits = Limits {
        wall: Duration::from_secs(2),
        cpu: Duration::from_secs(30),
        ..Limits::default()
    };
    let outcome = python(&sandbox, "while True:\n    pass\n", limits).await;
    assert_eq!(
        outcome.end,
        End::Limit {
            limit: LimitKind::WallTime
        }
    );
    assert!(outcome.usage.wall < Duration::from_secs(4));
    let limits = Limits {
        wall: Duration::from_secs(20),
        cpu: Duration::from_secs(1),
        ..Limits::default()
    };
    let outcome = python(&sandbox, "while True:\n    pass\n", limits).await;
    assert_eq!(
        outcome.end,
        End::Limit {
            limit: LimitKind::CpuTime
        }
    );
}

#[tokio::test]
async fn writing_a_10_gb_file_is_stopped() {
    let sandbox = sandbox().await;
    let code = r#"
chunk = b"x" * (1 << 20)
with open("/work/big", "wb") as f:
    for _ in range(10 * 1024):
        f.write(chunk)
print("WROTE 10 GB")
"#;
    // Python ignores SIGXFSZ, so the write fails with EFBIG instead.
    let outcome = python(&sandbox, code, short()).await;
    assert!(!outcome.stdout_text().contains("WROTE"));
    assert_eq!(outcome.end, End::Exited { code: 1 });
    assert!(outcome.stderr_text().contains("File too large"));
    // A program that does not is killed, and the run says by which limit.
    let mut job = Job::new(["sh", "-c", "exec head -c 10G /dev/zero > /work/big"]);
    job.limits = short();
    let outcome = sandbox.run(&job).await.unwrap();
    assert_eq!(
        outcome.end,
        End::Limit {
            limit: LimitKind::FileSize
        }
    );
    // Past the file limit, the scratch size bounds the total.
    let limits = Limits {
        file_bytes: 1 << 40,
        scratch_bytes: 8 << 20,
        ..short()
    };
    let code = r#"
chunk = b"x" * (1 << 20)
try:
    with open("/work/big", "wb") as f:
        for _ in range(10 * 1024):
            f.write(chunk)
    print("WROTE 10 GB")
except OSError as e:
    print("refused", e.errno)
"#;
    let outcome = python(&sandbox, code, limits).await;
    assert_eq!(outcome.stdout_text().trim(), "refused 28", "ENOSPC");
    host_still_works();
}

#[tokio::test]
async fn host_processes_cannot_be_signalled_or_traced() {
    let mut victim = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = victim.id();
    let sandbox = sandbox().await;
    let code = format!(
        r#"
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH = 16
for target in ({pid}, 1):
    try:
        os.kill(target, signal.SIGKILL)
        print("KILLED", target)
    except OSError as e:
        print("kill denied", target, type(e).__name__)
    if libc.ptrace(PTRACE_ATTACH, target, None, None) == 0:
        print("TRACED", target)
    else:
        print("ptrace denied", target, os.strerror(ctypes.get_errno()))
try:
    os.kill(-1, signal.SIGKILL)
except OSError as e:
    pass
print("survived")
"#
    );
    let outcome = python(&sandbox, &code, short()).await;
    let out = outcome.stdout_text();
    assert!(!out.contains("TRACED"), "{out}");
    assert!(!out.contains(&format!("KILLED {pid}")), "{out}");
    assert_eq!(out.matches("ptrace denied").count(), 2, "{out}");
    // The host's process is alive.
    assert!(
        victim.try_wait().unwrap().is_none(),
        "the host's process was killed"
    );
    victim.kill().unwrap();
    let _ = victim.wait();
}

#[tokio::test]
async fn nothing_is_left_running_after_a_run() {
    let sandbox = sandbox().await;
    let marker = format!("4242.{}", std::process::id());
    let mut job = Job::new([
        "sh",
        "-c",
        &format!(
            "sleep {marker} & python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep({marker})' & echo started"
        ),
    ]);
    job.limits = short();
    let outcome = sandbox.run(&job).await.unwrap();
    assert!(outcome.end.success());
    assert_eq!(outcome.stdout_text().trim(), "started");
    std::thread::sleep(Duration::from_millis(300));
    let left = host_processes_with(&marker);
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[tokio::test]
async fn setuid_binaries_do_not_raise_privileges() {
    // A setuid-root copy of `id` where the sandbox can see it: if the bit worked,
    // `id` would print an `euid=`.
    // Not under /tmp or /work (the sandbox's own): /var/tmp.
    let dir = PathBuf::from("/var/tmp").join(format!("agentstack-setuid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("id");
    std::fs::copy("/usr/bin/id", &copy).unwrap();
    let root = nix::unistd::Uid::effective().is_root();
    if root {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o4755)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let sandbox = Sandbox::start(SandboxConfig {
        read_only: vec![dir.clone()],
        ..config()
    })
    .await
    .unwrap();
    let mut job = Job::new([copy.to_str().unwrap()]);
    job.limits = short();
    let outcome = sandbox.run(&job).await.unwrap();
    let out = outcome.stdout_text();
    assert!(outcome.end.success(), "{}", outcome.stderr_text());
    assert!(out.starts_with("uid=1000(sandbox)"), "{out}");
    assert!(!out.contains("euid="), "{out}");
    // The system's own setuid binaries are no better.
    for su in ["/usr/bin/su", "/bin/su", "/usr/bin/passwd"] {
        if Path::new(su).exists() {
            let code = format!(
                "import os, subprocess\nst = os.stat({su:?})\nprint('setuid bit', bool(st.st_mode & 0o4000))\nr = subprocess.run([{su:?}, '--help'], capture_output=True)\nprint('ran', r.returncode)\nprint('euid', os.geteuid())"
            );
            let outcome = python(&sandbox, &code, short()).await;
            assert!(outcome.stdout_text().contains("euid 1000"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn bad_jobs_are_refused_before_anything_runs() {
    let sandbox = sandbox().await;
    let mut job = Job::new(["cat", "x"]);
    job.files.push(JobFile::new("../escape", "x"));
    let err = sandbox.run(&job).await.unwrap_err().to_string();
    assert!(err.contains("..") && err.contains("invalid job"), "{err}");
    let mut job = Job::new(["true"]);
    job.limits.wall = Duration::ZERO;
    assert!(sandbox.run(&job).await.is_err());
    let err = Sandbox::start(SandboxConfig {
        program: Some(PathBuf::from("/bin/true")),
        ..config()
    })
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("run_if_init"), "{err}");
}

#[tokio::test]
async fn a_full_queue_refuses_more_runs() {
    let sandbox = Sandbox::start(SandboxConfig {
        max_concurrent: 1,
        max_queued: 0,
        ..config()
    })
    .await
    .unwrap();
    let busy = sandbox.clone();
    let first = tokio::spawn(async move {
        let mut job = Job::new(["sleep", "1"]);
        job.limits = short();
        busy.run(&job).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = sandbox.run(&Job::new(["true"])).await.unwrap_err();
    assert!(
        matches!(err, agentstack_sandbox::Error::Busy { .. }),
        "{err}"
    );
    assert!(first.await.unwrap().unwrap().end.success());
    // With the slot free again, runs are accepted.
    assert!(
        sandbox
            .run(&Job::new(["true"]))
            .await
            .unwrap()
            .end
            .success()
    );
}

#[tokio::test]
async fn the_warm_pool_serves_concurrent_runs() {
    let sandbox = Sandbox::start(SandboxConfig {
        warm: 4,
        max_concurrent: 4,
        ..config()
    })
    .await
    .unwrap();
    let runs = (0..12).map(|i| {
        let sandbox = sandbox.clone();
        async move {
            let mut job = Job::new(["python3", "-c", &format!("print({i} * 2)")]);
            job.limits = short();
            sandbox.run(&job).await.unwrap()
        }
    });
    let outcomes = futures_util::future::join_all(runs).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        assert_eq!(outcome.stdout_text(), format!("{}\n", i * 2));
    }
}

/// Probes, each in a forked child so that one that got through cannot change what the
/// next sees: every dangerous system call prints `refused <name> <errno>` or
/// `ALLOWED <name>`. The numbers are this architecture's, passed in by the test.
const SYSCALL_PROBES: &str = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {nr}
CLONE_NEWNS, CLONE_NEWUSER, SIGCHLD = 0x20000, 0x10000000, 17

def call(name, *args):
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = libc.syscall(ctypes.c_long(NR[name]), *args)
    return result, ctypes.get_errno()

def io_uring_setup():
    params = ctypes.create_string_buffer(256)
    return call("io_uring_setup", 1, params)

def clone_with_namespaces():
    return call("clone", CLONE_NEWUSER | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0)

def clone3_with_namespaces():
    args = (ctypes.c_uint64 * 11)()
    args[0] = CLONE_NEWUSER
    args[4] = SIGCHLD
    return call("clone3", args, ctypes.sizeof(args))

def setns():
    fd = os.open("/proc/self/ns/uts", os.O_RDONLY)
    return call("setns", fd, 0)

def mount():
    os.makedirs("/work/mnt", exist_ok=True)
    return call("mount", b"none", b"/work/mnt", b"tmpfs", 0, None)

PROBES = {
    "io_uring_setup": io_uring_setup,
    "unshare": lambda: call("unshare", CLONE_NEWUSER),
    "clone": clone_with_namespaces,
    "clone3": clone3_with_namespaces,
    "keyctl": lambda: call("keyctl", 0, -3, 1),
    "bpf": lambda: call("bpf", 0, None, 0),
    "perf_event_open": lambda: call("perf_event_open", None, 0, -1, -1, 0),
    "userfaultfd": lambda: call("userfaultfd", 1 | os.O_CLOEXEC),
    "mount": mount,
    "setns": setns,
    "ptrace": lambda: call("ptrace", 0, 0, 0, 0),
}

for name, probe in PROBES.items():
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        result, errno = probe()
        if result == 0 and name in ("clone", "clone3"):
            os._exit(0)  # the clone's child
        print("ALLOWED" if result >= 0 else "refused", name, errno, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"#;

#[tokio::test]
async fn dangerous_system_calls_are_refused() {
    use nix::libc;
    let numbers = [
        ("io_uring_setup", libc::SYS_io_uring_setup),
        ("unshare", libc::SYS_unshare),
        ("clone", libc::SYS_clone),
        ("clone3", libc::SYS_clone3),
        ("keyctl", libc::SYS_keyctl),
        ("bpf", libc::SYS_bpf),
        ("perf_event_open", libc::SYS_perf_event_open),
        ("userfaultfd", libc::SYS_userfaultfd),
        ("mount", libc::SYS_mount),
        ("setns", libc::SYS_setns),
        ("ptrace", libc::SYS_ptrace),
    ];
    let table = numbers
        .iter()
        .map(|(name, nr)| format!("{name:?}: {nr}"))
        .collect::<Vec<_>>()
        .join(", ");
    let code = SYSCALL_PROBES.replace("{nr}", &format!("{{{table}}}"));
    let sandbox = sandbox().await;
    let outcome = python(&sandbox, &code, short()).await;
    assert!(outcome.end.success(), "{}", outcome.stderr_text());
    let out = outcome.stdout_text();
    assert!(!out.contains("ALLOWED"), "{out}");
    for (name, _) in numbers {
        // clone3 is ENOSYS so the C library falls back to clone.
        let errno = if name == "clone3" {
            libc::ENOSYS
        } else {
            libc::EPERM
        };
        assert!(
            out.lines()
                .any(|line| line == format!("refused {name} {errno}")),
            "{name} was not refused with errno {errno}:\n{out}"
        );
    }
}

#[tokio::test]
async fn python_threads_subprocesses_and_a_process_pool_still_work() {
    let sandbox = sandbox().await;
    let code = r#"
import multiprocessing, subprocess, sys, threading

def square(x):
    return x * x

if __name__ == "__main__":
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(square(i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("threads", sum(results))
    child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    print("subprocess", child.stdout.strip())
    with multiprocessing.Pool(2) as pool:
        print("pool", sum(pool.map(square, range(10))))
"#;
    let limits = Limits {
        wall: Duration::from_secs(20),
        cpu: Duration::from_secs(20),
        ..Limits::default()
    };
    let outcome = python(&sandbox, code, limits).await;
    assert!(outcome.end.success(), "{}", outcome.stderr_text());
    assert_eq!(
        outcome.stdout_text(),
        "threads 140\nsubprocess 42\npool 285\n"
    );
}

#[test]
fn the_sandbox_init_reveals_no_host_path_or_environment() {
    const CANARY: &str = "AGENTSTACK_TEST_CANARY";
    let canary_value = format!("host-secret-{}", std::process::id());
    let program = PathBuf::from(env!("CARGO_BIN_EXE_agentstack"));
    let code = r#"
import os
def show(label, read):
    try:
        value = read()
    except OSError as e:
        value = "unreadable " + type(e).__name__
    print(label, repr(value))
show("cmdline", lambda: open("/proc/1/cmdline", "rb").read())
show("comm", lambda: open("/proc/1/comm").read())
show("environ", lambda: open("/proc/1/environ", "rb").read())
show("exe", lambda: os.readlink("/proc/1/exe"))
show("mountinfo", lambda: open("/proc/self/mountinfo").read())
show("own_environ", lambda: dict(os.environ))
"#;
    let out = Command::new(&program)
        .env(CANARY, &canary_value)
        .args([
            "sandbox", "run", "--time", "10", "--", "python3", "-c", code,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{stdout}");
    assert_reveals_nothing(&stdout, &program, &canary_value);
    assert!(
        stdout.contains("cmdline b'sandbox-init\\x00__agentstack-sandbox-init\\x00'"),
        "{stdout}"
    );
    assert!(stdout.contains("comm 'sandbox-init\\n'"), "{stdout}");
}

/// Fails if `out` names `program` (its path, or its last two components, as a mount
/// of the file would show them) or contains `canary`.
fn assert_reveals_nothing(out: &str, program: &Path, canary: &str) {
    let path = program.to_string_lossy();
    let components: Vec<_> = program.components().collect();
    let tail: PathBuf = components[components.len() - 2..].iter().collect();
    let tail = tail.to_string_lossy();
    for secret in [path.as_ref(), tail.as_ref(), canary] {
        assert!(!out.contains(secret), "the sandbox sees {secret:?}:\n{out}");
    }
}

#[tokio::test]
async fn the_exposed_program_runs_without_revealing_its_host_path() {
    let program = PathBuf::from(env!("CARGO_BIN_EXE_agentstack"));
    let sandbox = Sandbox::start(SandboxConfig {
        expose_program: true,
        ..config()
    })
    .await
    .unwrap();
    let code = format!(
        r#"
import os, subprocess
print("mountinfo", repr(open("/proc/self/mountinfo").read()))
print("cmdline", repr(open("/proc/1/cmdline", "rb").read()))
ran = subprocess.run([{:?}, "--version"], capture_output=True, text=True)
print("ran", ran.returncode, ran.stdout.split()[0])
"#,
        agentstack_sandbox::PROGRAM_IN_SANDBOX
    );
    let outcome = python(&sandbox, &code, short()).await;
    assert!(outcome.end.success(), "{}", outcome.stderr_text());
    let out = outcome.stdout_text();
    assert_reveals_nothing(&out, &program, "no canary here");
    assert!(out.contains("ran 0 agentstack"), "{out}");
}

mod coding {
    //! The `coding` environment, its tests run in real sandboxes: every reference
    //! solution earns 1.0, a stub does not; a repository snapshot earns strictly
    //! between 0 and 1, its fix 1.0; the tools work; the conformance checks pass.

    use agentstack_envs::coding::{self, Task, TaskSet};
    use agentstack_protocol::http::ResetRequest;
    use serde_json::{Value, json};

    use super::config;

    fn spec() -> agentstack_env::EnvSpec {
        coding::spec_with(
            TaskSet::builtin(),
            agentstack_sandbox::SandboxConfig {
                warm: 2,
                max_concurrent: 2,
                ..config()
            },
        )
    }

    async fn episode(
        env: &mut Box<dyn agentstack_env::DynEnvironment>,
        task: &str,
        actions: &[Value],
    ) -> (f64, Value) {
        let reset = ResetRequest {
            options: json!({"task": task, "max_steps": 50})
                .as_object()
                .unwrap()
                .clone(),
            ..ResetRequest::default()
        };
        env.reset(reset).await.unwrap();
        let mut last = Value::Null;
        for action in actions {
            let raw = serde_json::value::to_raw_value(action).unwrap();
            let step = env.step(&raw).await.unwrap();
            last = serde_json::to_value(&step).unwrap();
        }
        (last["reward"].as_f64().unwrap_or(0.0), last)
    }

    #[tokio::test]
    async fn every_reference_passes_and_stubs_do_not() {
        let spec = spec();
        let mut env = spec.instantiate().unwrap();
        let set = TaskSet::builtin();
        let mut checked = 0;
        for task in set.tasks() {
            match task {
                Task::Function(t) => {
                    let (reward, last) =
                        episode(&mut env, &t.id, &[json!({"code": t.reference})]).await;
                    assert_eq!(
                        reward, 1.0,
                        "{}: the reference scored {reward}: {last}",
                        t.id
                    );
                    let stub =
                        format!("def {}(*args, **kwargs):\n    return None\n", t.entry_point);
                    let (reward, _) = episode(&mut env, &t.id, &[json!({"code": stub})]).await;
                    assert!(reward < 1.0, "{}: a stub scored {reward}", t.id);
                }
                Task::Repo(t) => {
                    let (reward, last) =
                        episode(&mut env, &t.id, &[json!({"tool": "submit"})]).await;
                    assert!(
                        reward > 0.0 && reward < 1.0,
                        "{}: the snapshot scored {reward}: {last}",
                        t.id
                    );
                    let mut fix: Vec<Value> = t
                        .solution
                        .iter()
                        .map(|(path, content)| json!({"tool": "write_file", "path": path, "content": content}))
                        .collect();
                    fix.push(json!({"tool": "submit"}));
                    let (reward, last) = episode(&mut env, &t.id, &fix).await;
                    assert_eq!(reward, 1.0, "{}: the fix scored {reward}: {last}", t.id);
                }
            }
            checked += 1;
        }
        assert!(checked >= 54);
    }

    #[tokio::test]
    async fn editing_the_visible_tests_does_not_raise_the_reward() {
        let spec = spec();
        let mut env = spec.instantiate().unwrap();
        let set = TaskSet::builtin();
        let Some(Task::Repo(task)) = set.tasks().iter().find(|t| t.kind() == "repo") else {
            panic!("a repository task is built in")
        };
        let (honest, _) = episode(&mut env, &task.id, &[json!({"tool": "submit"})]).await;
        // Replace every test file with one that passes, and add a passing test.
        let mut cheat: Vec<Value> = task
            .repo
            .keys()
            .filter(|p| p.starts_with("tests/test"))
            .map(|p| json!({"tool": "write_file", "path": p, "content": "import unittest\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"}))
            .collect();
        cheat.push(json!({"tool": "write_file", "path": "tests/test_extra.py", "content": "import unittest\nclass E(unittest.TestCase):\n    def test_a(self): pass\n    def test_b(self): pass\n"}));
        cheat.push(json!({"tool": "submit"}));
        let (cheated, _) = episode(&mut env, &task.id, &cheat).await;
        assert_eq!(cheated, honest);
        // Printing something that looks like results does not help either.
        let (reward, _) = episode(
            &mut env,
            "count_vowels",
            &[json!({"code": "print('{\"tests\": [{\"passed\": true}]}')\nimport os\nos._exit(0)\n"})],
        )
        .await;
        assert_eq!(reward, 0.0);
    }

    #[tokio::test]
    async fn tools_read_edit_and_test_a_repository() {
        let spec = spec();
        let mut env = spec.instantiate().unwrap();
        let names: Vec<String> = env.tools().into_iter().map(|t| t.name).collect();
        assert_eq!(
            names,
            [
                "write_file",
                "read_file",
                "list_files",
                "run_tests",
                "submit"
            ]
        );
        let set = TaskSet::builtin();
        let Some(Task::Repo(task)) = set.get("inventory_stock_checks") else {
            panic!("built in")
        };
        let reset = ResetRequest {
            options: json!({"task": task.id}).as_object().unwrap().clone(),
            ..ResetRequest::default()
        };
        let first = env.reset(reset).await.unwrap();
        let first = serde_json::to_value(&first).unwrap();
        assert!(
            first["observation"]["prompt"]
                .as_str()
                .unwrap()
                .contains("Inventory")
        );
        let call = |name: &str, args: Value| (name.to_owned(), args.as_object().unwrap().clone());
        let (name, args) = call("list_files", json!({}));
        let listed = env.call_tool(&name, args).await.unwrap();
        assert!(
            serde_json::to_string(&listed)
                .unwrap()
                .contains("invtrack/inventory.py")
        );
        let (name, args) = call("run_tests", json!({}));
        let ran = serde_json::to_string(&env.call_tool(&name, args).await.unwrap()).unwrap();
        assert!(ran.contains("FAILED"), "{ran}");
        for (path, content) in &task.solution {
            let (name, args) = call("write_file", json!({"path": path, "content": content}));
            env.call_tool(&name, args).await.unwrap();
        }
        let (name, args) = call("read_file", json!({"path": "nope.py"}));
        assert!(env.call_tool(&name, args).await.is_err());
        // A file whose text looks like an error is still just a file.
        let (name, args) = call(
            "write_file",
            json!({"path": "notes.txt", "content": "error: not really"}),
        );
        env.call_tool(&name, args).await.unwrap();
        let (name, args) = call("read_file", json!({"path": "notes.txt"}));
        let read = env.call_tool(&name, args).await.unwrap();
        let read = serde_json::to_string(&read).unwrap();
        assert!(read.contains("error: not really"), "{read}");
        let (name, args) = call("submit", json!({}));
        let submitted = serde_json::to_string(&env.call_tool(&name, args).await.unwrap()).unwrap();
        assert!(
            submitted.contains("\\\"reward\\\":1.0") || submitted.contains("1.0"),
            "{submitted}"
        );
        let state = env.state().unwrap();
        assert_eq!(state["hidden_passed"], state["hidden_total"]);
    }

    #[test]
    fn env_validate_passes_on_coding() {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentstack"))
            .args(["env", "validate", "coding"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
