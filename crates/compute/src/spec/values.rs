//! The value forms SkyPilot accepts for resources: `cpus: 4+`, `memory: 16GB`,
//! `accelerators: A100:8`, `ports: [8080, "9000-9010"]`, `job_recovery: FAILOVER`,
//! durations like `30s`; each parsed to a typed value and written back in a form that
//! parses to the same value.

use std::fmt;

use serde::{Serialize, Serializer};
use serde_norway::Value;

use super::error::SpecError;
use super::reader::{At, Keys, kind, whole};

/// Most CPUs one node may ask for; more is a typing mistake.
pub const MAX_CPUS: f64 = 100_000.0;
/// Most memory one node may ask for: 1 PB.
pub const MAX_MEMORY_BYTES: u64 = 1 << 50;
/// Most accelerators one node may ask for.
pub const MAX_ACCELERATORS: u64 = 1024;
/// Most restarts a recovery policy may allow; more is a crash loop.
pub const MAX_RESTARTS: u64 = 100_000;
/// Longest duration written in a spec: 30 days.
pub const MAX_DURATION_SECONDS: u64 = 30 * 24 * 3600;

const GIB: u64 = 1 << 30;

/// `cpus`: how many CPUs each node needs, exactly or at least.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cpus {
    /// The number (may be fractional: `0.5`).
    pub count: f64,
    /// `4+`: at least `count`.
    pub or_more: bool,
}

impl Cpus {
    pub(crate) fn parse(value: &Value, at: &At) -> Result<Self, SpecError> {
        let hint =
            "a number of CPUs greater than 0: `cpus: 4`, `cpus: 0.5`, or `cpus: 4+` for at least 4";
        let (text, or_more) = match value {
            Value::Number(n) => (n.to_string(), false),
            Value::String(s) => match s.trim().strip_suffix('+') {
                Some(rest) => (rest.trim().to_owned(), true),
                None => (s.trim().to_owned(), false),
            },
            other => {
                return Err(at.fix(
                    format!("must be a number or a string, found {}", kind(other)),
                    hint,
                ));
            }
        };
        match text.parse::<f64>() {
            Ok(count) if count > 0.0 && count <= MAX_CPUS => Ok(Self { count, or_more }),
            Ok(count) if count.is_finite() && count <= 0.0 => Err(at.fix(
                format!(
                    "{} CPUs is not a request: it must be more than 0",
                    display_number(count)
                ),
                hint,
            )),
            _ => Err(at.fix(
                format!("`{}` is not a number of CPUs", value_text(value)),
                hint,
            )),
        }
    }

    /// Whole CPUs, rounded up (Slurm and Kubernetes limits want whole or milli CPUs).
    pub fn whole(&self) -> u64 {
        self.count.ceil() as u64
    }
}

impl fmt::Display for Cpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}",
            display_number(self.count),
            if self.or_more { "+" } else { "" }
        )
    }
}

impl Serialize for Cpus {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.or_more {
            serializer.collect_str(self)
        } else {
            serialize_number(self.count, serializer)
        }
    }
}

/// `memory`: how much memory each node needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Memory {
    /// The amount.
    pub amount: MemoryAmount,
    /// `16GB+`: at least the amount.
    pub or_more: bool,
}

/// An amount of memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryAmount {
    /// Bytes, a whole number of KiB (SkyPilot's units are powers of 1024).
    Bytes(u64),
    /// `8x`: this many GiB per requested CPU.
    PerCpu(f64),
}

/// SkyPilot's memory units (`sky/skylet/constants.py::MEMORY_SIZE_UNITS`), all powers of 1024.
const MEMORY_UNITS: [(&str, u64); 10] = [
    ("kb", 1 << 10),
    ("ki", 1 << 10),
    ("mb", 1 << 20),
    ("mi", 1 << 20),
    ("gb", 1 << 30),
    ("gi", 1 << 30),
    ("tb", 1 << 40),
    ("ti", 1 << 40),
    ("pb", 1 << 50),
    ("pi", 1 << 50),
];

impl Memory {
    pub(crate) fn parse(value: &Value, at: &At) -> Result<Self, SpecError> {
        let hint = "a size: `memory: 16` (GB), `16GB`, `512MB`, `16GB+` for at least 16 GB, or `4x` for 4 GB per CPU; units KB, MB, GB, TB, PB (powers of 1024)";
        let text = match value {
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.trim().to_owned(),
            other => {
                return Err(at.fix(
                    format!("must be a number or a string, found {}", kind(other)),
                    hint,
                ));
            }
        };
        let (body, or_more) = match text.strip_suffix('+') {
            Some(rest) => (rest.trim_end(), true),
            None => (text.as_str(), false),
        };
        let bad = |why: &str| at.fix(format!("`{text}` is not a memory size: {why}"), hint);
        if body.starts_with('-') {
            return Err(bad("it must be more than 0"));
        }
        if let Some(ratio) = body.strip_suffix(['x', 'X']) {
            return match ratio.trim().parse::<f64>() {
                Ok(r) if r > 0.0 && r <= MAX_CPUS => Ok(Self {
                    amount: MemoryAmount::PerCpu(r),
                    or_more,
                }),
                _ => Err(bad("the ratio must be a number greater than 0")),
            };
        }
        let split = body
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(body.len());
        let (number, unit) = (body[..split].trim(), body[split..].trim());
        let number: f64 = number
            .parse()
            .map_err(|_| bad("it does not start with a number"))?;
        let multiplier = if unit.is_empty() {
            GIB
        } else {
            MEMORY_UNITS
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(unit))
                .map(|(_, m)| *m)
                .ok_or_else(|| bad(&format!("unknown unit `{unit}`")))?
        };
        let bytes = number * multiplier as f64;
        if bytes.is_nan() || bytes <= 0.0 {
            return Err(bad("it must be more than 0"));
        }
        if bytes > MAX_MEMORY_BYTES as f64 {
            return Err(bad("more than 1 PB"));
        }
        // Whole KiB, rounded up, so that every amount has an exact spelling in a unit.
        let bytes = (bytes / 1024.0).ceil() as u64 * 1024;
        Ok(Self {
            amount: MemoryAmount::Bytes(bytes),
            or_more,
        })
    }

    /// The bytes each node needs, given the CPUs it asked for (for `8x`).
    pub fn bytes(&self, cpus: Option<Cpus>) -> Option<u64> {
        match self.amount {
            MemoryAmount::Bytes(b) => Some(b),
            MemoryAmount::PerCpu(ratio) => {
                cpus.map(|c| (ratio * c.count * GIB as f64).ceil() as u64)
            }
        }
    }
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.amount {
            MemoryAmount::Bytes(bytes) => f.write_str(&format_bytes(bytes))?,
            MemoryAmount::PerCpu(ratio) => write!(f, "{}x", display_number(ratio))?,
        }
        if self.or_more {
            f.write_str("+")?;
        }
        Ok(())
    }
}

impl Serialize for Memory {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Bytes (a whole number of KiB) in the largest unit that divides them: `16GB`, `1536MB`.
pub fn format_bytes(bytes: u64) -> String {
    for (unit, size) in [
        ("PB", 1u64 << 50),
        ("TB", 1 << 40),
        ("GB", 1 << 30),
        ("MB", 1 << 20),
    ] {
        if bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    format!("{}KB", bytes.div_ceil(1024))
}

/// `accelerators`: a device type and how many each node needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accelerators {
    /// The type as written (`A100`, `H100-80GB`); backends pass it on as it is.
    pub name: String,
    /// How many per node.
    pub count: u32,
}

impl Accelerators {
    pub(crate) fn parse(value: &Value, at: &At) -> Result<Self, SpecError> {
        let hint = "one device type and a count: `accelerators: A100:8`, `accelerators: A100` (one), or `accelerators: {A100: 8}`";
        let (name, count) = match value {
            Value::String(s) => match s.rsplit_once(':') {
                Some((name, count)) => {
                    (name.trim().to_owned(), count_value(count.trim(), at, hint)?)
                }
                None => (s.trim().to_owned(), 1),
            },
            Value::Mapping(m) if m.len() == 1 => {
                let (name, count) = m.iter().next().expect("one entry");
                let Value::String(name) = name else {
                    return Err(at.fix("the device type must be a string", hint));
                };
                let count = match count {
                    Value::Null => 1,
                    Value::Number(n) => count_value(&n.to_string(), at, hint)?,
                    other => {
                        return Err(at.fix(
                            format!("the count must be a number, found {}", kind(other)),
                            hint,
                        ));
                    }
                };
                (name.trim().to_owned(), count)
            }
            Value::Mapping(_) | Value::Sequence(_) => {
                return Err(at.fix(
                    "lists of alternative accelerators are not supported: agentstack runs on the compute you name, it does not shop for it",
                    hint,
                ));
            }
            other => {
                return Err(at.fix(
                    format!("must be a string or a mapping, found {}", kind(other)),
                    hint,
                ));
            }
        };
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid_name {
            return Err(at.fix(
                format!("`{name}` is not a device type (letters, digits, '-', '_', '.')"),
                hint,
            ));
        }
        Ok(Self { name, count })
    }
}

fn count_value(text: &str, at: &At, hint: &str) -> Result<u32, SpecError> {
    let bad = || {
        at.fix(
            format!(
                "`{text}` is not a count of devices: whole devices only, 1 to {MAX_ACCELERATORS}"
            ),
            hint,
        )
    };
    let count: f64 = text.parse().map_err(|_| bad())?;
    if count.fract() != 0.0 || !(1.0..=MAX_ACCELERATORS as f64).contains(&count) {
        return Err(bad());
    }
    Ok(count as u32)
}

impl fmt::Display for Accelerators {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.count)
    }
}

impl Serialize for Accelerators {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// One port or an inclusive range of ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PortRange {
    /// First port.
    pub start: u16,
    /// Last port (equal to `start` for one port).
    pub end: u16,
}

impl PortRange {
    /// How many ports.
    pub fn len(&self) -> usize {
        usize::from(self.end - self.start) + 1
    }

    /// Always false: a range holds at least one port.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The ports, in order.
    pub fn ports(&self) -> impl Iterator<Item = u16> {
        self.start..=self.end
    }

    /// Reads `ports:` (one port, a `"9000-9010"` range, or a list of both).
    pub(crate) fn parse_list(value: &Value, at: &At) -> Result<Vec<Self>, SpecError> {
        let mut ranges = match value {
            Value::Sequence(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| Self::parse_one(item, &at.index(i)))
                .collect::<Result<Vec<_>, _>>()?,
            single => vec![Self::parse_one(single, at)?],
        };
        ranges.sort();
        for pair in ranges.windows(2) {
            if pair[1].start <= pair[0].end {
                return Err(at.fix(
                    format!("ports {} and {} overlap", pair[0], pair[1]),
                    "list each port once",
                ));
            }
        }
        Ok(ranges)
    }

    fn parse_one(value: &Value, at: &At) -> Result<Self, SpecError> {
        let hint = "ports are 1 to 65535: `ports: 8080`, `ports: \"9000-9010\"`, or a list `[8080, \"9000-9010\"]`";
        let text = match value {
            Value::Number(n) => n.to_string(),
            Value::String(s) => s.trim().to_owned(),
            other => {
                return Err(at.fix(
                    format!("a port must be a number or a string, found {}", kind(other)),
                    hint,
                ));
            }
        };
        let port = |t: &str| -> Result<u16, SpecError> {
            match t.trim().parse::<u32>() {
                Ok(p) if (1..=65535).contains(&p) => Ok(p as u16),
                Ok(p) => Err(at.fix(format!("port {p} is out of range"), hint)),
                Err(_) => Err(at.fix(format!("`{text}` is not a port or a range of ports"), hint)),
            }
        };
        let (start, end) = match text.split_once('-') {
            Some((a, b)) => (port(a)?, port(b)?),
            None => {
                let p = port(&text)?;
                (p, p)
            }
        };
        if start > end {
            return Err(at.fix(
                format!("the range {text} runs backwards"),
                format!("write it as \"{end}-{start}\""),
            ));
        }
        Ok(Self { start, end })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.start == self.end {
            write!(f, "{}", self.start)
        } else {
            write!(f, "{}-{}", self.start, self.end)
        }
    }
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.start == self.end {
            serializer.serialize_u16(self.start)
        } else {
            serializer.collect_str(self)
        }
    }
}

/// SkyPilot's recovery strategies. On the user's own compute both mean "launch the
/// component again on the same infra": there are no regions to move to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum RecoveryStrategy {
    /// `FAILOVER`: retry where it ran.
    #[serde(rename = "FAILOVER")]
    Failover,
    /// `EAGER_NEXT_REGION`: SkyPilot's default; treated as `FAILOVER`.
    #[serde(rename = "EAGER_NEXT_REGION")]
    EagerNextRegion,
}

/// `resources.job_recovery`: when a component that failed is started again.
///
/// As in SkyPilot: a failure that is not the program's own (a node lost, a preemption)
/// always relaunches it; an exit with a non-zero code relaunches it while
/// `max_restarts_on_errors` allows, or always when the code is one of
/// `recover_on_exit_codes`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct JobRecovery {
    /// The strategy named, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<RecoveryStrategy>,
    /// Restarts allowed after the program exits with an error.
    #[serde(skip_serializing_if = "is_zero")]
    pub max_restarts_on_errors: u32,
    /// Exit codes that always restart the program, without counting against the limit.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recover_on_exit_codes: Vec<u8>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl JobRecovery {
    pub(crate) fn parse(value: &Value, at: &At) -> Result<Self, SpecError> {
        match value {
            Value::String(s) => Ok(Self {
                strategy: Some(strategy(s, at)?),
                ..Self::default()
            }),
            Value::Mapping(_) => {
                let keys = Keys::read(
                    value,
                    at,
                    "job_recovery",
                    &["strategy", "max_restarts_on_errors", "recover_on_exit_codes"],
                    &[],
                )?;
                let strategy = match keys.get("strategy") {
                    Some(Value::String(s)) => Some(strategy(s, &at.key("strategy"))?),
                    Some(other) => {
                        return Err(at.key("strategy").fix(
                            format!("must be a string, found {}", kind(other)),
                            "FAILOVER or EAGER_NEXT_REGION",
                        ));
                    }
                    None => None,
                };
                let max_restarts_on_errors = match keys.get("max_restarts_on_errors") {
                    Some(v) => whole(v, &at.key("max_restarts_on_errors"), 0, MAX_RESTARTS)? as u32,
                    None => 0,
                };
                let recover_on_exit_codes = match keys.get("recover_on_exit_codes") {
                    Some(v) => exit_codes(v, &at.key("recover_on_exit_codes"))?,
                    None => Vec::new(),
                };
                Ok(Self {
                    strategy,
                    max_restarts_on_errors,
                    recover_on_exit_codes,
                })
            }
            other => Err(at.fix(
                format!("must be a strategy name or a mapping, found {}", kind(other)),
                "`job_recovery: FAILOVER` or `job_recovery: {max_restarts_on_errors: 3, recover_on_exit_codes: [33]}`",
            )),
        }
    }
}

fn strategy(name: &str, at: &At) -> Result<RecoveryStrategy, SpecError> {
    match name.trim().to_ascii_uppercase().as_str() {
        "FAILOVER" => Ok(RecoveryStrategy::Failover),
        "EAGER_NEXT_REGION" => Ok(RecoveryStrategy::EagerNextRegion),
        _ => Err(at.fix(
            format!("unknown recovery strategy `{name}`"),
            "FAILOVER or EAGER_NEXT_REGION",
        )),
    }
}

fn exit_codes(value: &Value, at: &At) -> Result<Vec<u8>, SpecError> {
    let hint = "exit codes 1 to 255, one or a list: `recover_on_exit_codes: [33, 34]`";
    let one = |v: &Value, at: &At| -> Result<u8, SpecError> {
        match v.as_u64() {
            Some(0) => Err(at.fix(
                "exit code 0 is success: restarting on it would run the program forever",
                hint,
            )),
            Some(code @ 1..=255) => Ok(code as u8),
            _ => Err(at.fix(format!("`{}` is not an exit code", value_text(v)), hint)),
        }
    };
    let mut codes = match value {
        Value::Sequence(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| one(v, &at.index(i)))
            .collect::<Result<Vec<_>, _>>()?,
        single => vec![one(single, at)?],
    };
    let listed = codes.len();
    codes.sort_unstable();
    codes.dedup();
    if codes.len() != listed {
        return Err(at.fix("an exit code is listed twice", hint));
    }
    Ok(codes)
}

/// A duration in whole seconds: `30`, `"30s"`, `"5m"`, `"2h"`, `"1d"`, `"1w"` (SkyPilot's
/// `TIME_UNITS_SECONDS`).
pub(crate) fn duration_seconds(value: &Value, at: &At) -> Result<u64, SpecError> {
    let hint = "a duration: `30s`, `5m`, `2h`, or a whole number of seconds";
    let text = match value {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.trim().to_owned(),
        other => return Err(at.fix(format!("must be a duration, found {}", kind(other)), hint)),
    };
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let factor = match unit.to_ascii_lowercase().as_str() {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 604_800,
        _ => return Err(at.fix(format!("`{text}` is not a duration"), hint)),
    };
    let seconds = number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(factor))
        .ok_or_else(|| at.fix(format!("`{text}` is not a duration"), hint))?;
    if seconds > MAX_DURATION_SECONDS {
        return Err(at.fix(format!("`{text}` is longer than 30 days"), hint));
    }
    Ok(seconds)
}

/// A number as the user would write it: `4`, `0.5`.
pub(crate) fn display_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

fn serialize_number<S: Serializer>(v: f64, serializer: S) -> Result<S::Ok, S::Error> {
    if v.fract() == 0.0 && (0.0..1e15).contains(&v) {
        serializer.serialize_u64(v as u64)
    } else {
        serializer.serialize_f64(v)
    }
}

pub(crate) fn value_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => kind(other).to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at() -> At {
        At::document(1).key("x")
    }

    fn yaml(text: &str) -> Value {
        serde_norway::from_str(text).unwrap()
    }

    #[test]
    fn cpus_forms() {
        assert_eq!(
            Cpus::parse(&yaml("4"), &at()).unwrap(),
            Cpus {
                count: 4.0,
                or_more: false
            }
        );
        assert_eq!(
            Cpus::parse(&yaml("4+"), &at()).unwrap(),
            Cpus {
                count: 4.0,
                or_more: true
            }
        );
        assert_eq!(Cpus::parse(&yaml("'0.5'"), &at()).unwrap().count, 0.5);
        assert_eq!(Cpus::parse(&yaml("2.5"), &at()).unwrap().whole(), 3);
        for bad in ["-4", "0", "four", "4++", "[4]", "1e9", ".nan"] {
            assert!(Cpus::parse(&yaml(bad), &at()).is_err(), "{bad}");
        }
    }

    #[test]
    fn memory_forms() {
        let bytes = |t: &str| Memory::parse(&yaml(t), &at()).unwrap().bytes(None);
        assert_eq!(bytes("16"), Some(16 << 30));
        assert_eq!(bytes("16GB"), Some(16 << 30));
        assert_eq!(bytes("16gi"), Some(16 << 30));
        assert_eq!(bytes("512MB"), Some(512 << 20));
        assert_eq!(bytes("0.5"), Some(512 << 20));
        assert_eq!(bytes("1.5TB"), Some(1536 << 30));
        assert!(Memory::parse(&yaml("32+"), &at()).unwrap().or_more);
        let per_cpu = Memory::parse(&yaml("4x"), &at()).unwrap();
        assert_eq!(
            per_cpu.bytes(Some(Cpus {
                count: 2.0,
                or_more: false
            })),
            Some(8 << 30)
        );
        assert_eq!(per_cpu.bytes(None), None);
        for bad in ["4XB", "-1", "0", "GB", "1e30", "16 G B", "x"] {
            assert!(Memory::parse(&yaml(bad), &at()).is_err(), "{bad}");
        }
        assert_eq!(format_bytes(1536 << 20), "1536MB");
        assert_eq!(format_bytes(3 << 10), "3KB");
    }

    #[test]
    fn accelerator_forms() {
        let a = |t: &str| Accelerators::parse(&yaml(t), &at());
        assert_eq!(
            a("A100:8").unwrap(),
            Accelerators {
                name: "A100".into(),
                count: 8
            }
        );
        assert_eq!(a("H100").unwrap().count, 1);
        assert_eq!(a("{A100: 8}").unwrap().count, 8);
        for bad in [
            "A100:0.5",
            "A100:0",
            "[A100, H100]",
            "{A100: 1, H100: 1}",
            "'A 100'",
            "':2'",
        ] {
            assert!(a(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn port_forms() {
        let p = |t: &str| PortRange::parse_list(&yaml(t), &at());
        assert_eq!(
            p("8080").unwrap(),
            vec![PortRange {
                start: 8080,
                end: 8080
            }]
        );
        assert_eq!(p("[9000-9010, 8080]").unwrap().len(), 2);
        assert_eq!(p("'9000-9010'").unwrap()[0].len(), 11);
        for bad in [
            "0",
            "65536",
            "'10-5'",
            "[8080, 8080]",
            "['8000-8100', 8050]",
            "http",
            "{a: 1}",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations() {
        let d = |t: &str| duration_seconds(&yaml(t), &at());
        assert_eq!(d("30").unwrap(), 30);
        assert_eq!(d("30s").unwrap(), 30);
        assert_eq!(d("2M").unwrap(), 120);
        assert_eq!(d("1h").unwrap(), 3600);
        for bad in ["-1", "1y", "1.5m", "99999999999999999999w", "60d"] {
            assert!(d(bad).is_err(), "{bad}");
        }
    }
}
