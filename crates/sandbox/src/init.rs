//! The sandbox's init process: a fresh, single-threaded copy of the host program that
//! isolates itself, then runs exactly one job and exits.
//!
//! Why a separate process started by `exec` rather than a `fork` of the host: creating
//! a user namespace needs a single-threaded caller, and the host (a tokio runtime) has
//! many threads. The init process is the host's own executable started with
//! [`INIT_ARG`](crate::wire::INIT_ARG); the binary calls [`run_if_init`] first thing in
//! `main`. Its `argv[0]` and name are [`INIT_NAME`](crate::wire::INIT_NAME) and its
//! environment is empty, so a command reading `/proc/1/cmdline`, `comm` or `environ`
//! learns nothing of the host (`/proc/1/exe` and `environ` are unreadable to it anyway:
//! pid 1 holds capabilities the command lacks).
//!
//! Isolation, in order (see [`prepare`]):
//! 1. started by root: drop to an unprivileged host uid/gid (`nobody`) and no groups;
//! 2. `unshare` user, mount, network, IPC, UTS and cgroup namespaces; map uid/gid 1000
//!    inside to that host id (no other id exists inside);
//! 3. a new root on a tmpfs: `/usr`, `/bin`, `/lib*` bind-mounted read-only, `nosuid`,
//!    `nodev`; a synthetic `/etc`; a minimal `/dev`; `/work`, the one writable scratch
//!    tmpfs (size-limited), with `/tmp` and `/dev/shm` links into it; the old root
//!    detached;
//! 4. loopback up in the fresh network namespace (no other interface, no route).
//!
//! Per job (see [`run_job`]): a new PID namespace whose init (`B`) mounts `/proc` and
//! forks the command (`C`); `C` starts a session, gets rlimits, `no_new_privs` and the
//! system-call filter ([`crate::seccomp`]), and `exec`s, which drops every capability
//! (uid 1000 is not root). When `C` exits, `B`
//! reports its status and exits, and the kernel kills whatever `C` left behind. When the
//! init process exits, its mount namespace and the scratch tmpfs go with it: nothing is
//! left on the host.
#![expect(
    unsafe_code,
    reason = "fork, exec and namespace set-up in a single-threaded init process"
)]

use std::ffi::{CString, OsStr};
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, symlink};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sched::{CloneFlags, unshare};
use nix::sys::resource::{Resource, setrlimit};
use nix::sys::signal::{Signal, kill};
use nix::sys::statvfs::{FsFlags, statvfs};
use nix::unistd::{ForkResult, Gid, Pid, Uid, fork, pipe2};

use crate::job::{End, LimitKind, Usage, check_relative_path};
use crate::seccomp::SyscallFilter;
use crate::wire::{FileHeader, Hello, INIT_ARG, Isolation, JobHeader, Report, Setup};

/// [`INIT_NAME`](crate::wire::INIT_NAME) for `prctl(PR_SET_NAME)`.
const INIT_NAME_C: &std::ffi::CStr = c"sandbox-init";

/// The uid and gid the command has inside the sandbox.
pub const SANDBOX_ID: u32 = 1000;
/// The scratch directory inside the sandbox.
pub const SCRATCH: &str = "/work";
/// `PATH` inside the sandbox.
pub const SANDBOX_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Host directories bind-mounted read-only into every sandbox (those that exist;
/// symbolic links such as a merged `/bin -> usr/bin` are recreated as links).
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];
/// Host files under `/etc` the dynamic loader and interpreters read.
const ETC_FILES: &[&str] = &[
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
];
/// Device nodes bound into `/dev`.
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// If this process was started as a sandbox init, runs it and exits; otherwise returns
/// at once. Call it first thing in `main`, before any thread starts.
pub fn run_if_init() {
    if std::env::args_os().nth(1).as_deref() != Some(OsStr::new(INIT_ARG)) {
        return;
    }
    std::process::exit(main());
}

/// A failed step of setting up or running.
struct Failure {
    step: String,
    message: String,
}

trait Step<T> {
    fn step(self, step: &'static str) -> Result<T, Failure>;
}

impl<T, E: std::fmt::Display> Step<T> for Result<T, E> {
    fn step(self, step: &'static str) -> Result<T, Failure> {
        self.map_err(|e| Failure {
            step: step.to_owned(),
            message: e.to_string(),
        })
    }
}

fn main() -> i32 {
    let mut control_in = io::stdin().lock();
    let mut control_out = io::stdout().lock();
    let setup = match crate::wire::read_header::<Setup>(&mut control_in) {
        Ok(Some(setup)) => setup,
        Ok(None) | Err(_) => {
            eprintln!("{INIT_ARG}: expected the set-up on stdin");
            return 2;
        }
    };
    let setup = &setup;
    let prepared = match setup.isolation {
        Isolation::Namespaces => prepare(setup).map(Prepared::Isolated),
        Isolation::UnsafeNone => unsafe_scratch().map(Prepared::Unisolated),
    };
    let prepared = match prepared {
        Ok(prepared) => prepared,
        Err(failure) => {
            let hello = Hello::Failed {
                step: failure.step,
                message: failure.message,
            };
            let _ = crate::wire::write_header(&mut control_out, &hello);
            let _ = control_out.flush();
            return 1;
        }
    };
    if crate::wire::write_header(&mut control_out, &Hello::Ready)
        .and_then(|()| control_out.flush())
        .is_err()
    {
        return prepared.finish(1);
    }
    // A pool may discard a warm sandbox by closing its stdin.
    let header = match crate::wire::read_header::<JobHeader>(&mut control_in) {
        Ok(Some(header)) => header,
        Ok(None) | Err(_) => return prepared.finish(0),
    };
    let ran = receive_and_run(&prepared, &header, &mut control_in).unwrap_or_else(|failure| {
        (
            Report {
                end: End::NotStarted,
                usage: Usage::default(),
                stdout_len: 0,
                stderr_len: 0,
                stdout_truncated: false,
                stderr_truncated: false,
                error: Some(format!("{}: {}", failure.step, failure.message)),
            },
            Vec::new(),
            Vec::new(),
        )
    });
    let (report, stdout, stderr) = ran;
    let sent = crate::wire::write_header(&mut control_out, &report)
        .and_then(|()| control_out.write_all(&stdout))
        .and_then(|()| control_out.write_all(&stderr))
        .and_then(|()| control_out.flush());
    prepared.finish(i32::from(sent.is_err()))
}

/// A sandbox ready for its job.
enum Prepared {
    /// Isolated; the PID namespace's init process (`B`) keeps the namespace alive.
    Isolated(Pid),
    /// No isolation; the scratch directory on the host.
    Unisolated(PathBuf),
}

impl Prepared {
    fn scratch(&self) -> PathBuf {
        match self {
            Self::Isolated(_) => PathBuf::from(SCRATCH),
            Self::Unisolated(dir) => dir.clone(),
        }
    }

    /// Ends the sandbox: the PID namespace (every process in it) or the host scratch
    /// directory.
    fn finish(&self, code: i32) -> i32 {
        match self {
            Self::Isolated(pid_one) => {
                let _ = kill(*pid_one, Signal::SIGKILL);
                let _ = nix::sys::wait::waitpid(*pid_one, None);
            }
            Self::Unisolated(dir) => {
                let _ = fs::remove_dir_all(dir);
            }
        }
        code
    }
}

/// Makes this process an isolated sandbox (steps 1–4 of the module docs) and starts
/// the PID namespace's init, `B`, which builds the new root (it must: `/proc` can only
/// be mounted from inside the PID namespace, and only while the host's `/proc` is still
/// visible) and then stays, reaping orphans, until the job ends.
fn prepare(setup: &Setup) -> Result<Pid, Failure> {
    if Uid::effective().is_root() {
        let id = setup.unprivileged_id;
        nix::unistd::setgroups(&[]).step("drop supplementary groups")?;
        nix::unistd::setresgid(Gid::from_raw(id), Gid::from_raw(id), Gid::from_raw(id))
            .step("switch to the unprivileged group")?;
        nix::unistd::setresuid(Uid::from_raw(id), Uid::from_raw(id), Uid::from_raw(id))
            .step("switch to the unprivileged user")?;
        // Changing uid makes the process non-dumpable, which would make its own
        // /proc/self/uid_map unwritable.
        nix::sys::prctl::set_dumpable(true).step("mark the process dumpable")?;
    }
    let (outer_uid, outer_gid) = (Uid::effective().as_raw(), Gid::effective().as_raw());
    unshare(
        CloneFlags::CLONE_NEWUSER
            | CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWCGROUP,
    )
    .step("create user, mount, network, IPC, UTS and cgroup namespaces")?;
    fs::write("/proc/self/setgroups", "deny").step("deny setgroups")?;
    fs::write(
        "/proc/self/uid_map",
        format!("{SANDBOX_ID} {outer_uid} 1\n"),
    )
    .step("write the uid map")?;
    fs::write(
        "/proc/self/gid_map",
        format!("{SANDBOX_ID} {outer_gid} 1\n"),
    )
    .step("write the gid map")?;
    nix::unistd::sethostname("sandbox").step("set the host name")?;
    // Later children of this process are born in the new PID namespace; the first is
    // its init.
    unshare(CloneFlags::CLONE_NEWPID).step("create a PID namespace")?;
    let (ready_r, ready_w) = pipe2(OFlag::O_CLOEXEC).step("create a pipe")?;
    // SAFETY: this process is single-threaded (the init process never starts threads).
    match unsafe { fork() }.step("start the PID namespace's init")? {
        ForkResult::Child => {
            drop(ready_r);
            // If the init process dies, so does `B`, and with it the namespace.
            let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
            // What the command sees of its pid 1 (`/proc/1/comm`), rather than the
            // host program's file name.
            let _ = nix::sys::prctl::set_name(INIT_NAME_C);
            let built = build_root(setup).and_then(|()| loopback_up().step("bring up loopback"));
            let message = match &built {
                Ok(()) => String::new(),
                Err(failure) => format!("{}\0{}", failure.step, failure.message),
            };
            let _ = nix::unistd::write(&ready_w, message.as_bytes());
            drop(ready_w);
            if built.is_err() {
                // SAFETY: leaving the forked child without the parent's destructors.
                unsafe { libc::_exit(1) }
            }
            reap_forever()
        }
        ForkResult::Parent { child } => {
            drop(ready_w);
            let mut message = Vec::new();
            let _ = fs::File::from(ready_r).read_to_end(&mut message);
            if message.is_empty() {
                return Ok(child);
            }
            let _ = nix::sys::wait::waitpid(child, None);
            let text = String::from_utf8_lossy(&message);
            let (step, message) = text
                .split_once('\0')
                .unwrap_or(("build the sandbox's root", &text));
            Err(Failure {
                step: step.to_owned(),
                message: message.to_owned(),
            })
        }
    }
}

/// `B` after the root is built: pid 1 of the namespace. Orphans of the job are
/// reparented here; it reaps them until the init process kills it (which ends the
/// namespace and everything in it) or dies (then the kernel kills `B`).
fn reap_forever() -> ! {
    // SAFETY: close_range(2) on this process's own descriptors: `B` needs none.
    unsafe { libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) };
    loop {
        let mut status = 0;
        // SAFETY: waitpid(2) with a valid out-pointer.
        if unsafe { libc::waitpid(-1, &mut status, 0) } < 0 {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Step 3: the new root.
fn build_root(setup: &Setup) -> Result<(), Failure> {
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .step("make mounts private")?;
    // The new root is a small tmpfs over /tmp (any directory would do; /tmp exists
    // everywhere). Extra read-only paths are bound before it hides /tmp's contents.
    let root = Path::new("/tmp");
    // The host's neutral link to the program, not the program's own path (a bind
    // mount's root, in /proc/self/mountinfo, is the path of the file bound). It is
    // opened in this mount namespace, before the new root hides /tmp.
    let program = match &setup.exposed_program {
        Some(path) => Some(fs::File::open(path).step("open the program")?),
        None => None,
    };
    mount(
        Some("tmpfs"),
        root,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("size=1m,nr_inodes=4096,mode=0755"),
    )
    .step("mount the new root")?;
    for dir in SYSTEM_DIRS.iter().chain(ETC_FILES) {
        bind_read_only(Path::new(dir), root)?;
    }
    for path in &setup.read_only {
        bind_read_only(path, root)?;
    }
    if let Some(program) = &program {
        bind_program(program, root)?;
    }
    let etc = root.join("etc");
    fs::create_dir_all(&etc).step("create /etc")?;
    let files: [(&str, String); 4] = [
        (
            "passwd",
            format!(
                "root:x:0:0:root:/:/usr/sbin/nologin\nsandbox:x:{SANDBOX_ID}:{SANDBOX_ID}:sandbox:{SCRATCH}:/bin/sh\nnobody:x:65534:65534:nobody:/:/usr/sbin/nologin\n"
            ),
        ),
        (
            "group",
            format!("root:x:0:\nsandbox:x:{SANDBOX_ID}:\nnogroup:x:65534:\n"),
        ),
        (
            "hosts",
            "127.0.0.1 localhost sandbox\n::1 localhost\n".into(),
        ),
        (
            "nsswitch.conf",
            "passwd: files\ngroup: files\nhosts: files\n".into(),
        ),
    ];
    for (name, contents) in files {
        fs::write(etc.join(name), contents).step("write /etc")?;
    }
    // /dev: the harmless character devices, and links into /proc and the scratch.
    let dev = root.join("dev");
    fs::create_dir(&dev).step("create /dev")?;
    mount(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("size=64k,nr_inodes=64,mode=0755"),
    )
    .step("mount /dev")?;
    for name in DEVICES {
        let source = Path::new("/dev").join(name);
        if source.exists() {
            let target = dev.join(name);
            fs::write(&target, b"").step("create a device mount point")?;
            mount(Some(&source), &target, none, MsFlags::MS_BIND, none).step("bind a device")?;
        }
    }
    // /dev/shm, where POSIX semaphores and shared memory live (Python's
    // multiprocessing locks need them): a directory in the scratch tmpfs, so it counts
    // against the job's scratch size and goes with it.
    for (name, target) in [
        ("shm", "/work/.shm"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, dev.join(name)).step("link /dev")?;
    }
    remount_read_only(&dev, MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC).step("make /dev read-only")?;
    // /work: the one writable place, a size-limited tmpfs owned by the sandbox user.
    // Its size is set per job (a remount) once the job's limits are known.
    let work = root.join(SCRATCH.trim_start_matches('/'));
    fs::create_dir(&work).step("create /work")?;
    mount(
        Some("tmpfs"),
        &work,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(
            format!("size=64m,nr_inodes=65536,mode=0755,uid={SANDBOX_ID},gid={SANDBOX_ID}")
                .as_str(),
        ),
    )
    .step("mount the scratch directory")?;
    symlink("/work/.tmp", root.join("tmp")).step("link /tmp")?;
    // This process is pid 1 of the new PID namespace: its /proc shows only the job.
    fs::create_dir(root.join("proc")).step("create /proc")?;
    mount(
        Some("proc"),
        &root.join("proc"),
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        none,
    )
    .step("mount /proc")?;
    remount_read_only(root, MsFlags::MS_NOSUID | MsFlags::MS_NODEV)
        .step("make the root read-only")?;
    // Switch to the new root and detach the old one entirely.
    nix::unistd::chdir(root).step("enter the new root")?;
    nix::unistd::pivot_root(".", ".").step("pivot to the new root")?;
    umount2(".", MntFlags::MNT_DETACH).step("detach the old root")?;
    nix::unistd::chdir("/").step("enter /")?;
    Ok(())
}

/// Binds the program (opened as `program`) read-only at
/// [`crate::PROGRAM_IN_SANDBOX`].
fn bind_program(program: &fs::File, root: &Path) -> Result<(), Failure> {
    use std::os::fd::AsRawFd;
    let target = root.join(crate::PROGRAM_IN_SANDBOX.trim_start_matches('/'));
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).step("create the program's directory")?;
    }
    fs::write(&target, b"").step("create the program's mount point")?;
    let none: Option<&str> = None;
    let source = format!("/proc/self/fd/{}", program.as_raw_fd());
    mount(Some(source.as_str()), &target, none, MsFlags::MS_BIND, none).step("bind the program")?;
    remount_read_only(
        &target,
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_BIND,
    )
    .step("make the program read-only")
}

/// Binds `source` read-only at the same path under `root` (or recreates it as a link).
fn bind_read_only(source: &Path, root: &Path) -> Result<(), Failure> {
    let Ok(meta) = fs::symlink_metadata(source) else {
        return Ok(());
    };
    let relative = source.strip_prefix("/").unwrap_or(source);
    let target = root.join(relative);
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).step("create a mount point's parent")?;
    }
    if meta.file_type().is_symlink() {
        let link = fs::read_link(source).step("read a link")?;
        return symlink(link, &target).step("recreate a link");
    }
    if meta.is_dir() {
        fs::create_dir_all(&target).step("create a mount point")?;
    } else {
        fs::write(&target, b"").step("create a mount point")?;
    }
    let none: Option<&str> = None;
    mount(
        Some(source),
        &target,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )
    .step("bind a read-only path")?;
    // A bind remount must keep the flags the original mount has locked (noexec,
    // atime settings); read them from the source.
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if let Ok(stat) = statvfs(source) {
        let f = stat.flags();
        for (fs_flag, ms_flag) in [
            (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
            (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
            (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
            (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
        ] {
            if f.contains(fs_flag) {
                flags |= ms_flag;
            }
        }
    }
    remount_read_only(&target, flags | MsFlags::MS_BIND).step("make a bound path read-only")
}

fn remount_read_only(path: &Path, flags: MsFlags) -> nix::Result<()> {
    let none: Option<&str> = None;
    mount(
        none,
        path,
        none,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | flags,
        none,
    )
}

/// Step 4: `ip link set lo up`, with the two ioctls it makes.
fn loopback_up() -> io::Result<()> {
    // SAFETY: plain socket(2); the descriptor is owned right away.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: an all-zero ifreq is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *slot = *byte as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write an ifreq we own.
    unsafe {
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) < 0 {
            return Err(io::Error::last_os_error());
        }
        request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A scratch directory on the host, for `Isolation::UnsafeNone` only.
fn unsafe_scratch() -> Result<PathBuf, Failure> {
    let dir = std::env::temp_dir().join(format!("agentstack-sandbox-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir(&dir).step("create the scratch directory")?;
    Ok(dir)
}

type Ran = (Report, Vec<u8>, Vec<u8>);

fn receive_and_run(
    prepared: &Prepared,
    header: &JobHeader,
    control_in: &mut impl Read,
) -> Result<Ran, Failure> {
    let scratch = prepared.scratch();
    let mut stdin = vec![0u8; usize::try_from(header.stdin_len).step("stdin size")?];
    control_in.read_exact(&mut stdin).step("receive stdin")?;
    if let Prepared::Isolated(_) = prepared {
        // Size the scratch tmpfs for this job.
        let none: Option<&str> = None;
        mount(
            none,
            &scratch,
            none,
            MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(format!("size={}", header.limits.scratch_bytes).as_str()),
        )
        .step("size the scratch directory")?;
    }
    for file in &header.files {
        receive_file(&scratch, file, control_in)?;
    }
    fs::create_dir_all(scratch.join(".tmp")).step("create /tmp")?;
    fs::create_dir_all(scratch.join(".shm")).step("create /dev/shm")?;
    run_job(prepared, header, &scratch, stdin)
}

fn receive_file(scratch: &Path, file: &FileHeader, input: &mut impl Read) -> Result<(), Failure> {
    check_relative_path(&file.path).map_err(|message| Failure {
        step: "check a file path".into(),
        message,
    })?;
    let path = scratch.join(&file.path);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).step("create a file's directory")?;
    }
    let mut out = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if file.executable { 0o755 } else { 0o644 })
        .open(&path)
        .step("create a file")?;
    let copied = io::copy(&mut input.take(file.len), &mut out).step("write a file")?;
    if copied != file.len {
        return Err(Failure {
            step: "receive a file".into(),
            message: format!("{} ended after {copied} of {} bytes", file.path, file.len),
        });
    }
    Ok(())
}

/// Everything the command's process needs, built before forking so the children only
/// make system calls.
struct Exec {
    program: CString,
    argv: Vec<CString>,
    env: Vec<CString>,
    cwd: CString,
    limits: [(Resource, u64, u64); 6],
    /// The paths to try in order: the program itself, or a bare name looked up on
    /// the sandbox's `PATH`.
    candidates: Vec<CString>,
    /// The system-call filter, compiled.
    filter: SyscallFilter,
}

impl Exec {
    fn new(header: &JobHeader, scratch: &Path) -> Result<Self, Failure> {
        let cstring = |s: &str| CString::new(s).step("encode an argument");
        let argv = header
            .argv
            .iter()
            .map(|a| cstring(a))
            .collect::<Result<Vec<_>, _>>()?;
        let program = argv.first().cloned().ok_or(Failure {
            step: "read the command".into(),
            message: "empty command".into(),
        })?;
        let candidates = if header.argv[0].contains('/') {
            vec![program.clone()]
        } else {
            SANDBOX_PATH
                .split(':')
                .map(|dir| {
                    CString::new(format!("{dir}/{}", header.argv[0]))
                        .step("encode the program path")
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        let home = scratch.to_string_lossy().into_owned();
        let mut env = vec![
            format!("PATH={SANDBOX_PATH}"),
            format!("HOME={home}"),
            format!("TMPDIR={home}/.tmp"),
            "LANG=C.UTF-8".to_owned(),
            "PYTHONDONTWRITEBYTECODE=1".to_owned(),
        ];
        env.extend(header.env.iter().map(|(k, v)| format!("{k}={v}")));
        let limits = &header.limits;
        let cpu = limits.cpu.as_secs().max(1);
        let filter = SyscallFilter::new().step("compile the system-call filter")?;
        Ok(Self {
            candidates,
            filter,
            program,
            argv,
            env: env.iter().map(|e| cstring(e)).collect::<Result<_, _>>()?,
            cwd: cstring(&home)?,
            limits: [
                // SIGXCPU at the soft limit, SIGKILL a second later.
                (Resource::RLIMIT_CPU, cpu, cpu + 1),
                (
                    Resource::RLIMIT_AS,
                    limits.memory_bytes,
                    limits.memory_bytes,
                ),
                (Resource::RLIMIT_NPROC, limits.processes, limits.processes),
                (Resource::RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
                (Resource::RLIMIT_NOFILE, 256, 256),
                (Resource::RLIMIT_CORE, 0, 0),
            ],
        })
    }
}

/// Starts the command (`C`, born in the PID namespace) and collects its output.
fn run_job(
    prepared: &Prepared,
    header: &JobHeader,
    scratch: &Path,
    stdin: Vec<u8>,
) -> Result<Ran, Failure> {
    let exec = Exec::new(header, scratch)?;
    let (out_r, out_w) = pipe2(OFlag::O_CLOEXEC).step("create a pipe")?;
    let (err_r, err_w) = pipe2(OFlag::O_CLOEXEC).step("create a pipe")?;
    let (in_r, in_w) = pipe2(OFlag::O_CLOEXEC).step("create a pipe")?;
    let started = Instant::now();
    // SAFETY: this process is single-threaded (the init process never starts threads),
    // and the child only makes system calls before exec or _exit.
    let child = match unsafe { fork() }.step("start the command")? {
        ForkResult::Child => {
            drop((out_r, err_r, in_w));
            let code = command(&exec, &in_r, &out_w, &err_w);
            // SAFETY: leaving the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => child,
    };
    drop((out_w, err_w, in_r));
    let pid_one = match prepared {
        Prepared::Isolated(pid) => Some(*pid),
        Prepared::Unisolated(_) => None,
    };
    supervise(child, pid_one, header, stdin, out_r, err_r, in_w, started)
}

/// `C`: the command. Never returns on success.
fn command(exec: &Exec, stdin: &OwnedFd, stdout: &OwnedFd, stderr: &OwnedFd) -> i32 {
    let fail = |what: &[u8]| {
        let _ = nix::unistd::write(stderr, what);
        126
    };
    if nix::unistd::setsid().is_err() {
        return fail(b"sandbox: setsid failed\n");
    }
    if nix::unistd::dup2_stdin(stdin).is_err()
        || nix::unistd::dup2_stdout(stdout).is_err()
        || nix::unistd::dup2_stderr(stderr).is_err()
    {
        return fail(b"sandbox: could not connect stdio\n");
    }
    // SAFETY: close_range(2) on descriptors this process owns; 0–2 are kept.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    for (resource, soft, hard) in exec.limits {
        if setrlimit(resource, soft, hard).is_err() {
            return fail(b"sandbox: could not set a resource limit\n");
        }
    }
    if nix::sys::prctl::set_no_new_privs().is_err() {
        return fail(b"sandbox: could not set no_new_privs\n");
    }
    if nix::unistd::chdir(exec.cwd.as_c_str()).is_err() {
        return fail(b"sandbox: could not enter the scratch directory\n");
    }
    // Last, so that everything above may still use what it refuses; the command and
    // everything it starts inherit it.
    if exec.filter.install().is_err() {
        return fail(b"sandbox: could not install the system-call filter\n");
    }
    let mut last = Errno::ENOENT;
    for path in &exec.candidates {
        match nix::unistd::execve(path, &exec.argv, &exec.env) {
            Err(Errno::ENOENT) | Err(Errno::ENOTDIR) => {}
            Err(e) => last = e,
            Ok(never) => match never {},
        }
    }
    let _ = nix::unistd::write(io::stderr(), b"sandbox: cannot execute ");
    let _ = nix::unistd::write(io::stderr(), exec.program.as_bytes());
    let _ = nix::unistd::write(io::stderr(), b": ");
    let _ = nix::unistd::write(io::stderr(), last.desc().as_bytes());
    let _ = nix::unistd::write(io::stderr(), b"\n");
    127
}

/// One output stream being collected.
struct Capture {
    fd: Option<OwnedFd>,
    data: Vec<u8>,
    truncated: bool,
}

impl Capture {
    fn new(fd: OwnedFd) -> Self {
        Self {
            fd: Some(fd),
            data: Vec::new(),
            truncated: false,
        }
    }

    /// Reads what is there; returns whether the cap was passed.
    fn read(&mut self, cap: usize) -> bool {
        let Some(fd) = &self.fd else { return false };
        let mut buf = [0u8; 65536];
        match nix::unistd::read(fd, &mut buf) {
            Ok(0) => {
                self.fd = None;
                false
            }
            Ok(n) => {
                let room = cap.saturating_sub(self.data.len());
                self.data.extend_from_slice(&buf[..n.min(room)]);
                if n > room {
                    self.truncated = true;
                }
                self.truncated
            }
            Err(Errno::EINTR) | Err(Errno::EAGAIN) => false,
            Err(_) => {
                self.fd = None;
                false
            }
        }
    }
}

/// Feeds stdin, collects stdout and stderr up to the cap, enforces the wall-clock and
/// output limits, and ends everything the command started once it exits.
#[expect(
    clippy::too_many_arguments,
    reason = "the pipes of one job, passed once"
)]
fn supervise(
    child: Pid,
    pid_one: Option<Pid>,
    header: &JobHeader,
    stdin: Vec<u8>,
    out_r: OwnedFd,
    err_r: OwnedFd,
    in_w: OwnedFd,
    started: Instant,
) -> Result<Ran, Failure> {
    let cap = usize::try_from(header.limits.output_bytes).unwrap_or(usize::MAX);
    let deadline = started + header.limits.wall;
    let mut stdout = Capture::new(out_r);
    let mut stderr = Capture::new(err_r);
    let mut input = (!stdin.is_empty()).then_some(in_w);
    if let Some(fd) = &input {
        let _ = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
    }
    let mut written = 0usize;
    // A pidfd tells when the command exits even if something it left behind keeps its
    // output pipes open.
    // SAFETY: pidfd_open(2) on our own child; the descriptor is owned right away.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, child.as_raw(), 0) };
    if raw < 0 {
        let _ = kill(child, Signal::SIGKILL);
        return Err(Failure {
            step: "watch the command (pidfd_open, Linux 5.3+)".into(),
            message: io::Error::last_os_error().to_string(),
        });
    }
    // SAFETY: `raw` is a fresh descriptor nobody else owns.
    let mut exited_fd = Some(unsafe { OwnedFd::from_raw_fd(raw as i32) });
    let mut status: Option<(i32, libc::rusage)> = None;
    let mut stopped: Option<LimitKind> = None;
    // Ends the command and everything it started: the whole PID namespace (its init
    // dying takes every process in it), or without one, the command's process group.
    let kill_all = || match pid_one {
        Some(pid) => {
            let _ = kill(pid, Signal::SIGKILL);
        }
        None => {
            let _ = kill(Pid::from_raw(-child.as_raw()), Signal::SIGKILL);
        }
    };
    let control = io::stdin();
    while stdout.fd.is_some() || stderr.fd.is_some() || exited_fd.is_some() {
        let now = Instant::now();
        if now >= deadline && stopped.is_none() {
            stopped = Some(LimitKind::WallTime);
            kill_all();
        }
        let wait = if stopped.is_some() || status.is_some() {
            // Only draining now; the kill is under way.
            Duration::from_millis(200)
        } else {
            deadline.saturating_duration_since(now)
        };
        let timeout = PollTimeout::try_from(wait.as_millis().min(60_000) as i32 + 1)
            .unwrap_or(PollTimeout::MAX);
        let mut which: Vec<u8> = Vec::with_capacity(5);
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(5);
        if let Some(fd) = &stdout.fd {
            which.push(0);
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
        }
        if let Some(fd) = &stderr.fd {
            which.push(1);
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
        }
        if let Some(fd) = &exited_fd {
            which.push(2);
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
        }
        if let Some(fd) = &input {
            which.push(3);
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLOUT));
        }
        // The host closing our stdin means it is gone: stop everything.
        // SAFETY: fd 0 stays open for the life of this process.
        let control_fd = unsafe { BorrowedFd::borrow_raw(control.as_raw_fd()) };
        which.push(4);
        fds.push(PollFd::new(control_fd, PollFlags::empty()));
        let polled = poll(&mut fds, timeout);
        let ready: Vec<(u8, PollFlags)> = which
            .iter()
            .zip(&fds)
            .map(|(which, fd)| (*which, fd.revents().unwrap_or(PollFlags::empty())))
            .filter(|(_, revents)| !revents.is_empty())
            .collect();
        drop(fds);
        match polled {
            // The command has ended and nothing more came within the drain window:
            // whatever still holds the pipes is being killed; stop waiting for it.
            Ok(0) if status.is_some() => break,
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => break,
        }
        for (which, revents) in ready {
            match which {
                0 | 1 => {
                    let capture = if which == 0 { &mut stdout } else { &mut stderr };
                    if capture.read(cap) && stopped.is_none() {
                        stopped = Some(LimitKind::Output);
                        kill_all();
                    }
                }
                2 => {
                    exited_fd = None;
                    status = Some(reap(child));
                    // The command is done; whatever it left behind goes now.
                    kill_all();
                }
                3 => {
                    let done = match input
                        .as_ref()
                        .map(|fd| nix::unistd::write(fd, &stdin[written..]))
                    {
                        Some(Ok(n)) => {
                            written += n;
                            written >= stdin.len()
                        }
                        Some(Err(Errno::EAGAIN)) | Some(Err(Errno::EINTR)) => false,
                        _ => true,
                    };
                    if done {
                        input = None;
                    }
                }
                _ => {
                    if revents.intersects(PollFlags::POLLHUP | PollFlags::POLLERR) {
                        kill_all();
                        std::process::exit(3);
                    }
                }
            }
        }
    }
    drop(input);
    let (raw_status, rusage) = match status {
        Some(status) => status,
        None => reap(child),
    };
    let wall = started.elapsed();
    let cpu = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    let usage = Usage {
        wall,
        cpu_user: cpu(rusage.ru_utime),
        cpu_system: cpu(rusage.ru_stime),
        max_rss_bytes: (rusage.ru_maxrss.max(0) as u64) * 1024,
    };
    let end = if let Some(limit) = stopped {
        End::Limit { limit }
    } else if libc::WIFEXITED(raw_status) {
        match libc::WEXITSTATUS(raw_status) {
            127 if stderr.data.starts_with(b"sandbox: cannot execute") => End::NotStarted,
            code => End::Exited { code },
        }
    } else {
        let signal = libc::WTERMSIG(raw_status);
        let cpu_used = usage.cpu_user + usage.cpu_system;
        if signal == libc::SIGXCPU
            || (signal == libc::SIGKILL
                && cpu_used + Duration::from_millis(50) >= header.limits.cpu)
        {
            End::Limit {
                limit: LimitKind::CpuTime,
            }
        } else if signal == libc::SIGXFSZ {
            End::Limit {
                limit: LimitKind::FileSize,
            }
        } else {
            End::Signaled { signal }
        }
    };
    let report = Report {
        end,
        usage,
        stdout_len: stdout.data.len() as u64,
        stderr_len: stderr.data.len() as u64,
        stdout_truncated: stdout.truncated,
        stderr_truncated: stderr.truncated,
        error: None,
    };
    Ok((report, stdout.data, stderr.data))
}

/// Waits for the command; its status and the resources it (and the children it waited
/// for) used.
fn reap(child: Pid) -> (i32, libc::rusage) {
    let mut raw = 0;
    // SAFETY: an all-zero rusage is valid; wait4(2) fills it.
    let mut rusage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: wait4(2) on our own child with valid out-pointers.
        let pid = unsafe { libc::wait4(child.as_raw(), &mut raw, 0, &mut rusage) };
        if pid >= 0 || Errno::last() != Errno::EINTR {
            return (raw, rusage);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_init_process_takes_its_own_name() {
        assert_eq!(INIT_NAME_C.to_str(), Ok(crate::wire::INIT_NAME));
    }
}
