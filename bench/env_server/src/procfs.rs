//! What the benchmark reads from `/proc`: a process's CPU time and resident memory,
//! and a description of the machine.

use std::fs;

use agentstack_bench_support::machine;
use anyhow::{Context, Result, bail};

/// CPU time a process has used, in clock ticks: user + system time of all its
/// threads, plus that of its children it has waited for (`utime + stime + cutime +
/// cstime` in `/proc/<pid>/stat`).
pub fn cpu_ticks(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/stat");
    let stat = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_cpu_ticks(&stat).with_context(|| format!("parsing {path}"))
}

/// CPU time this process (the load generator) has used, in clock ticks.
pub fn own_cpu_ticks() -> Result<u64> {
    cpu_ticks(std::process::id())
}

fn parse_cpu_ticks(stat: &str) -> Result<u64> {
    // The command name (field 2) is in parentheses and may hold spaces or ')', so
    // count fields from the last ')'. After it come field 3 (state) onwards;
    // utime, stime, cutime, cstime are fields 14 to 17.
    let Some(close) = stat.rfind(')') else {
        bail!("no ')' after the command name");
    };
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let mut ticks = 0u64;
    for field in 14..=17 {
        let value = fields
            .get(field - 3)
            .with_context(|| format!("no field {field}"))?;
        // cutime and cstime are signed in the kernel's format; they are never
        // negative in practice, but do not let a bad value wrap.
        let value: i64 = value.parse().with_context(|| format!("field {field}"))?;
        ticks += u64::try_from(value).unwrap_or(0);
    }
    Ok(ticks)
}

/// Resident set size of a process, KiB (`VmRSS` in `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    status_number(&status, "VmRSS").with_context(|| format!("no VmRSS in {path}"))
}

/// Number of threads of a process (`Threads` in `/proc/<pid>/status`).
pub fn threads(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    status_number(&status, "Threads").with_context(|| format!("no Threads in {path}"))
}

/// The first number on the line `key:` of a `/proc/<pid>/status`-like file.
fn status_number(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// Clock ticks per second, the unit of [`cpu_ticks`]. Falls back to 100 (the value
/// on every Linux build that matters) if `sysconf` does not say.
pub fn clock_ticks_per_second() -> (u64, bool) {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(hz)) if hz > 0 => (hz.unsigned_abs(), true),
        _ => (100, false),
    }
}

/// The machine the benchmark ran on.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Logical CPUs (`processor` lines in `/proc/cpuinfo`).
    pub cpus: usize,
    /// `model name` from `/proc/cpuinfo`.
    pub model: String,
    /// Total memory, KiB.
    pub mem_total_kib: u64,
    /// `/proc/loadavg`'s three load averages.
    pub load_average: String,
}

impl Machine {
    /// Reads the machine's description now.
    pub fn read() -> Self {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpus = cpuinfo
            .lines()
            .filter(|line| line.starts_with("processor"))
            .count();
        Self {
            model: machine::cpu_model().unwrap_or_else(|| "unknown".to_owned()),
            mem_total_kib: machine::mem_total_kib().unwrap_or(0),
            cpus,
            load_average: load_average(),
        }
    }
}

/// `/proc/loadavg`'s 1, 5 and 15 minute load averages.
pub fn load_average() -> String {
    machine::load_average().unwrap_or_else(|| "unknown".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_sum_utime_stime_cutime_cstime() {
        // Field 2 holds a space and a ')' to check the parser counts from the last ')'.
        let stat = "1234 (py thon) x) S 1 2 3 4 5 6 7 8 9 10 11 22 33 44 55 20 0 1 0";
        assert_eq!(parse_cpu_ticks(stat).unwrap(), 11 + 22 + 33 + 44);
    }

    #[test]
    fn own_process_is_readable() {
        let pid = std::process::id();
        assert!(rss_kib(pid).unwrap() > 0);
        assert!(threads(pid).unwrap() >= 1);
        own_cpu_ticks().unwrap();
    }

    #[test]
    fn status_lines_are_found_by_key() {
        let status = "Name:\tx\nVmRSSX:\t1 kB\nVmRSS:\t  4242 kB\nThreads:\t3\n";
        assert_eq!(status_number(status, "VmRSS"), Some(4242));
        assert_eq!(status_number(status, "Threads"), Some(3));
        assert_eq!(status_number(status, "VmHWM"), None);
    }
}
