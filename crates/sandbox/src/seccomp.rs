//! The system-call filter (seccomp-bpf) every sandboxed command runs under: a denylist
//! of the calls that widen the kernel's attack surface or undo the isolation, in the
//! spirit of Docker's and Podman's default profiles.
//!
//! Refused with `EPERM`:
//! - new namespaces: `unshare` and `setns` entirely, `clone` with any `CLONE_NEW*` flag
//!   (nested user namespaces are the usual first step of a kernel exploit);
//! - `io_uring_setup`, `io_uring_enter`, `io_uring_register` (a large, often-exploited
//!   interface that also bypasses the filter's view of I/O);
//! - the kernel keyring (`keyctl`, `add_key`, `request_key`), `bpf`, `perf_event_open`,
//!   `userfaultfd` (a classic race amplifier);
//! - mounting: `mount`, `umount2`, `pivot_root` and the new mount API (`open_tree`,
//!   `move_mount`, `fsopen`, `fsmount`, `fsconfig`, `fspick`, `mount_setattr`);
//! - other processes' memory: `ptrace`, `process_vm_readv`/`writev`, `pidfd_getfd`,
//!   `process_madvise`, `kcmp`;
//! - `name_to_handle_at` and `open_by_handle_at` (opening files by handle escapes a
//!   chroot or bind mount);
//! - machine-wide state: modules, `kexec_*`, `swapon`/`swapoff`, `reboot`, setting the
//!   clock, `acct`, `quotactl`, `lookup_dcookie`, `syslog`, `fanotify_init`, and on
//!   x86_64 `iopl`/`ioperm`;
//! - `personality` with anything but the default (`PER_LINUX`) or a query: no turning
//!   address-space randomization off.
//!
//! `clone3` fails with `ENOSYS`: its flags sit in a struct a filter cannot read, and
//! `ENOSYS` makes the C library fall back to `clone`, whose flags it can (what Docker
//! and Podman do). Threads and `fork` keep working.
//!
//! Any other architecture than the one the sandbox was built for (i386 through
//! `int 0x80`, or the x32 ABI, on x86_64) kills the process: its system-call numbers
//! differ and would slip past the list.

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// System calls refused outright with `EPERM`.
const DENIED: &[libc::c_long] = &[
    // New namespaces.
    libc::SYS_unshare,
    libc::SYS_setns,
    // io_uring.
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    // The kernel keyring.
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    // Kernel programs, performance counters, user-space page faults.
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    // Mounting.
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsmount,
    libc::SYS_fsconfig,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    // Other processes' memory and descriptors.
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_process_madvise,
    libc::SYS_kcmp,
    // Files by handle.
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    // The machine itself.
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_reboot,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_quotactl_fd,
    libc::SYS_lookup_dcookie,
    libc::SYS_syslog,
    libc::SYS_fanotify_init,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
];

/// The `clone` flags that create namespaces. (`CLONE_NEWTIME` is missing on purpose:
/// `clone` reads that bit as part of the exit signal; only `clone3` and `unshare` take
/// it, and both are refused.)
const NAMESPACE_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWNS,
    libc::CLONE_NEWCGROUP,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
];

/// `personality(2)` arguments allowed: the default, and `0xffffffff`, which only asks.
const PERSONALITY_DEFAULT: u64 = 0;
const PERSONALITY_QUERY: u64 = 0xffff_ffff;

/// The x86_64 system-call numbers with this bit set are the x32 ABI's.
#[cfg(target_arch = "x86_64")]
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// The compiled filter, ready to install; built before `fork` so installing it in the
/// child makes system calls only.
pub(crate) struct SyscallFilter {
    programs: Vec<BpfProgram>,
}

impl SyscallFilter {
    /// Compiles the filter for the architecture this program was built for.
    pub(crate) fn new() -> Result<Self, seccompiler::Error> {
        let arch = TargetArch::try_from(std::env::consts::ARCH)?;
        let mut refused: std::collections::BTreeMap<i64, Vec<SeccompRule>> =
            DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
        let flag_rules = NAMESPACE_FLAGS
            .iter()
            .map(|&flag| {
                let flag = u64::from(flag as u32);
                SeccompRule::new(vec![SeccompCondition::new(
                    0,
                    SeccompCmpArgLen::Dword,
                    SeccompCmpOp::MaskedEq(flag),
                    flag,
                )?])
            })
            .collect::<Result<Vec<_>, _>>()?;
        refused.insert(libc::SYS_clone, flag_rules);
        let personality = SeccompRule::new(vec![
            SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Ne,
                PERSONALITY_DEFAULT,
            )?,
            SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Ne,
                PERSONALITY_QUERY,
            )?,
        ])?;
        refused.insert(libc::SYS_personality, vec![personality]);
        let refused = SeccompFilter::new(
            refused,
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EPERM as u32),
            arch,
        )?;
        // A second filter, since one filter has one action for all it matches.
        let clone3 = SeccompFilter::new(
            [(libc::SYS_clone3, Vec::new())].into(),
            SeccompAction::Allow,
            SeccompAction::Errno(libc::ENOSYS as u32),
            arch,
        )?;
        let mut programs = vec![refused.try_into()?, clone3.try_into()?];
        #[cfg(target_arch = "x86_64")]
        programs.push(x32_killer());
        Ok(Self { programs })
    }

    /// Installs the filter on the calling thread (and sets `no_new_privs`, which it
    /// needs); every process it starts inherits it, and nothing can remove it.
    pub(crate) fn install(&self) -> Result<(), seccompiler::Error> {
        self.programs
            .iter()
            .try_for_each(|program| seccompiler::apply_filter(program))
    }
}

/// Kills a process that makes an x32-ABI system call: those carry x86_64's audit
/// architecture (so the architecture check passes) but other numbers (so the list
/// would miss them). seccompiler's filters only compare numbers for equality, hence
/// this one, by hand.
#[cfg(target_arch = "x86_64")]
fn x32_killer() -> BpfProgram {
    use seccompiler::sock_filter;
    // The classic BPF opcodes of linux/bpf_common.h.
    /// `BPF_LD | BPF_W | BPF_ABS`.
    const LOAD_WORD: u16 = 0x20;
    /// `BPF_JMP | BPF_JGE | BPF_K`.
    const JUMP_IF_AT_LEAST: u16 = 0x35;
    /// `BPF_RET | BPF_K`.
    const RETURN: u16 = 0x06;
    // Offset of `nr` in `struct seccomp_data`.
    const SYSCALL_NUMBER: u32 = 0;
    let step = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        step(LOAD_WORD, 0, 0, SYSCALL_NUMBER),
        step(JUMP_IF_AT_LEAST, 0, 1, X32_SYSCALL_BIT),
        step(RETURN, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        step(RETURN, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

#[cfg(test)]
#[expect(unsafe_code, reason = "raw system calls and fork, to probe the filter")]
mod tests {
    use super::*;

    /// Runs `probe` on a fresh thread with the filter installed (a filter binds only
    /// the thread that installs it and the ones it starts, so the test process stays
    /// unfiltered).
    fn filtered<T: Send + 'static>(probe: impl FnOnce() -> T + Send + 'static) -> T {
        let filter = SyscallFilter::new().expect("the filter compiles");
        std::thread::spawn(move || {
            filter.install().expect("the filter installs");
            probe()
        })
        .join()
        .expect("the probe thread ran")
    }

    /// Makes the raw system call `nr` with `args`; its errno, or 0 if it succeeded.
    fn errno_of(nr: libc::c_long, args: [libc::c_long; 5]) -> i32 {
        let [a, b, c, d, e] = args;
        // SAFETY: every call the tests make is refused by the filter before the kernel
        // looks at its arguments, and has arguments the kernel would refuse anyway
        // (null pointers, a bad descriptor, clashing flags), so a filter that let one
        // through still changes nothing outside its thread.
        if unsafe { libc::syscall(nr, a, b, c, d, e) } < 0 {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
        } else {
            0
        }
    }

    #[test]
    fn refused_calls_fail_with_eperm_and_clone3_with_enosys() {
        let new_ns = libc::c_long::from(libc::CLONE_NEWNS);
        let new_user = libc::c_long::from(libc::CLONE_NEWUSER);
        // CLONE_FS with a new mount namespace is EINVAL.
        let bad_clone = new_ns | libc::c_long::from(libc::CLONE_FS | libc::SIGCHLD);
        // ADDR_NO_RANDOMIZE (on this thread only, were it let through).
        let no_aslr = 0x0040000;
        let calls = [
            (libc::SYS_io_uring_setup, [1, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_unshare, [new_user, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_setns, [-1, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_keyctl, [0, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_bpf, [0, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_perf_event_open, [0, 0, -1, -1, 0], libc::EPERM),
            (libc::SYS_userfaultfd, [-1, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_mount, [0, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_open_by_handle_at, [-1, 0, 0, 0, 0], libc::EPERM),
            (
                libc::SYS_ptrace,
                [libc::PTRACE_PEEKUSER.into(), -1, 0, 0, 0],
                libc::EPERM,
            ),
            (libc::SYS_personality, [no_aslr, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_clone, [bad_clone, 0, 0, 0, 0], libc::EPERM),
            (libc::SYS_clone3, [0, 0, 0, 0, 0], libc::ENOSYS),
        ];
        let expected: Vec<_> = calls.iter().map(|&(nr, _, errno)| (nr, errno)).collect();
        let got = filtered(move || {
            calls
                .iter()
                .map(|&(nr, args, _)| (nr, errno_of(nr, args)))
                .collect::<Vec<_>>()
        });
        assert_eq!(got, expected);
    }

    #[test]
    fn ordinary_calls_still_work_under_the_filter() {
        let (personality, thread, pid) = filtered(|| {
            // SAFETY: a query that changes nothing.
            let personality = unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffffu32) };
            // Threads use clone without namespace flags (after clone3's ENOSYS).
            let thread = std::thread::spawn(|| 6 * 7).join().ok();
            let pid = std::process::id();
            (personality, thread, pid)
        });
        assert!(personality >= 0);
        assert_eq!(thread, Some(42));
        assert_eq!(pid, std::process::id());
        // A child process (fork and exec, through clone) runs too.
        let out = filtered(|| std::process::Command::new("true").status().ok());
        assert!(out.is_some_and(|status| status.success()));
    }

    /// Forks a child that installs the filter and makes one call through `call`;
    /// returns the signal that killed it, if one did.
    #[cfg(target_arch = "x86_64")]
    fn killing_signal(call: fn()) -> Option<i32> {
        let filter = SyscallFilter::new().expect("the filter compiles");
        // SAFETY: the child only makes system calls before _exit (the filter is
        // compiled already).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = if filter.install().is_ok() {
                call();
                0
            } else {
                3
            };
            // SAFETY: leaving the forked child without the parent's destructors.
            unsafe { libc::_exit(code) }
        }
        let mut status = 0;
        // SAFETY: waitpid(2) on our own child with a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status))
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn foreign_abis_are_killed() {
        // getpid through the x32 ABI.
        let x32 = killing_signal(|| {
            // SAFETY: getpid takes no arguments; the filter kills the caller first.
            unsafe { libc::syscall(libc::SYS_getpid | X32_SYSCALL_BIT as libc::c_long) };
        });
        assert_eq!(x32, Some(libc::SIGSYS));
        // getpid (20) through the i386 entry point.
        let i386 = killing_signal(|| {
            // SAFETY: `int 0x80` with eax = 20 (i386 getpid) changes only eax.
            unsafe {
                std::arch::asm!("int 0x80", inout("eax") 20 => _, options(nostack));
            }
        });
        assert_eq!(i386, Some(libc::SIGSYS));
        // The native getpid is fine.
        let native = killing_signal(|| {
            // SAFETY: getpid takes no arguments.
            unsafe { libc::syscall(libc::SYS_getpid) };
        });
        assert_eq!(native, None);
    }
}
