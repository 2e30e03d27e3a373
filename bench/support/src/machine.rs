//! The machine a benchmark ran on, read from `/proc`, and the time it ran.

use std::time::{SystemTime, UNIX_EPOCH};

/// `model name` from `/proc/cpuinfo`; `None` where it cannot be read.
pub fn cpu_model() -> Option<String> {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
}

/// `MemTotal` from `/proc/meminfo`, KiB.
pub fn mem_total_kib() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kib| kib.parse().ok())
        })
}

/// `/proc/loadavg`'s 1, 5 and 15 minute load averages, as it prints them.
pub fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// The kernel's release (`uname -r`); empty where it cannot be read.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// The machine as a report's header line and its JSON name it.
#[derive(Debug, Clone)]
pub struct Machine {
    /// When the run ended, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// Logical CPUs this process may use.
    pub cpus: usize,
    /// `model name` from `/proc/cpuinfo`, else `unknown CPU`.
    pub cpu_model: String,
    /// `N.N GiB RAM`; empty where `/proc/meminfo` cannot be read.
    pub memory: String,
    /// The kernel's release.
    pub kernel: String,
    /// The load averages when the run started.
    pub load_start: String,
    /// And when it ended.
    pub load_end: String,
}

impl Machine {
    /// Reads the machine now, with the load averages taken at the run's start and end.
    pub fn here(load_start: String, load_end: String) -> Self {
        Self {
            date: utc_now(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model: cpu_model().unwrap_or_else(|| "unknown CPU".into()),
            memory: mem_total_kib().map_or_else(String::new, |kib| {
                format!("{:.1} GiB RAM", kib as f64 / 1024.0 / 1024.0)
            }),
            kernel: kernel_release(),
            load_start,
            load_end,
        }
    }
}

/// Now, as `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let (year, month, day) = civil_from_days(days);
    let in_day = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        in_day / 3600,
        in_day % 3600 / 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        year,
        u32::try_from(month).unwrap_or(1),
        u32::try_from(day).unwrap_or(1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_from_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }

    #[test]
    fn now_reads_as_a_utc_minute() {
        let now = utc_now();
        assert_eq!(now.len(), "2026-01-01 00:00 UTC".len(), "{now}");
        assert!(now.ends_with(" UTC"), "{now}");
    }

    #[test]
    fn this_machine_is_readable() {
        assert!(load_average().is_some_and(|l| l.split(' ').count() == 3));
        assert!(mem_total_kib().is_some_and(|kib| kib > 0));
    }
}
