//! Reading YAML values with the key path at hand, so every error says where it is.

use serde_norway::Value;

use super::error::{Location, SpecError};

/// Where the reader is: document, component, key path.
#[derive(Debug, Clone)]
pub(crate) struct At {
    document: usize,
    component: Option<String>,
    path: String,
}

impl At {
    pub(crate) fn document(document: usize) -> Self {
        Self {
            document,
            component: None,
            path: String::new(),
        }
    }

    pub(crate) fn in_component(&self, name: &str) -> Self {
        Self {
            component: Some(name.to_owned()),
            ..self.clone()
        }
    }

    pub(crate) fn key(&self, key: &str) -> Self {
        let path = if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        };
        Self {
            path,
            ..self.clone()
        }
    }

    pub(crate) fn index(&self, index: usize) -> Self {
        Self {
            path: format!("{}[{index}]", self.path),
            ..self.clone()
        }
    }

    /// An error here, with an optional hint.
    pub(crate) fn error(&self, message: impl Into<String>, hint: Option<String>) -> SpecError {
        SpecError::Invalid {
            location: Location {
                document: self.document,
                component: self.component.clone(),
                path: self.path.clone(),
            },
            message: message.into(),
            hint,
        }
    }

    /// An error here with a hint.
    pub(crate) fn fix(&self, message: impl Into<String>, hint: impl Into<String>) -> SpecError {
        self.error(message, Some(hint.into()))
    }
}

/// The keys of one YAML mapping, checked against the ones allowed there.
pub(crate) struct Keys<'a> {
    entries: Vec<(&'a str, &'a Value)>,
}

/// What a key that SkyPilot has but agentstack does not is answered with.
pub(crate) type NotSupported<'a> = &'a [(&'a str, &'a str)];

impl<'a> Keys<'a> {
    /// Reads a mapping. `what` names it in errors ("a task", "resources"); a key outside
    /// `allowed` is an error that names it and lists the allowed ones; a key in
    /// `not_supported` (SkyPilot's, which we do not implement) says why.
    pub(crate) fn read(
        value: &'a Value,
        at: &At,
        what: &str,
        allowed: &[&str],
        not_supported: NotSupported<'_>,
    ) -> Result<Self, SpecError> {
        let Value::Mapping(mapping) = value else {
            return Err(at.fix(
                format!("{what} must be a mapping of keys, found {}", kind(value)),
                format!("allowed keys: {}", allowed.join(", ")),
            ));
        };
        let mut entries = Vec::with_capacity(mapping.len());
        for (key, value) in mapping {
            let Value::String(key) = key else {
                return Err(at.fix(
                    format!("keys must be strings, found {}", kind(key)),
                    format!("allowed keys: {}", allowed.join(", ")),
                ));
            };
            if !allowed.contains(&key.as_str()) {
                let allowed_list = format!("allowed keys in {what}: {}", allowed.join(", "));
                if let Some((_, why)) = not_supported.iter().find(|(k, _)| k == key) {
                    return Err(at.key(key).fix(
                        format!(
                            "`{key}` is a SkyPilot key that agentstack does not support: {why}"
                        ),
                        allowed_list,
                    ));
                }
                let hint = match closest(key, allowed) {
                    Some(near) => format!("did you mean `{near}`? {allowed_list}"),
                    None => allowed_list,
                };
                return Err(at.key(key).fix(format!("unknown key `{key}`"), hint));
            }
            entries.push((key.as_str(), value));
        }
        Ok(Self { entries })
    }

    /// The value of `key`, when present and not null.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.entries
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .filter(|v| !v.is_null())
    }
}

/// What kind of YAML value this is, in words.
pub(crate) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing (null)",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// A string value.
pub(crate) fn string(value: &Value, at: &At) -> Result<String, SpecError> {
    match value {
        Value::String(s) => Ok(s.clone()),
        other => Err(at.error(format!("must be a string, found {}", kind(other)), None)),
    }
}

/// A whole number in `min..=max`.
pub(crate) fn whole(value: &Value, at: &At, min: u64, max: u64) -> Result<u64, SpecError> {
    let range_hint = || format!("a whole number from {min} to {max}");
    match value {
        Value::Number(n) => match n.as_u64() {
            Some(v) if (min..=max).contains(&v) => Ok(v),
            _ => Err(at.fix(format!("{n} is out of range"), range_hint())),
        },
        other => Err(at.fix(
            format!("must be a whole number, found {}", kind(other)),
            range_hint(),
        )),
    }
}

/// A signed whole number in `min..=max`.
pub(crate) fn integer(value: &Value, at: &At, min: i64, max: i64) -> Result<i64, SpecError> {
    let range_hint = || format!("a whole number from {min} to {max}");
    match value {
        Value::Number(n) => match n.as_i64() {
            Some(v) if (min..=max).contains(&v) => Ok(v),
            _ => Err(at.fix(format!("{n} is out of range"), range_hint())),
        },
        other => Err(at.fix(
            format!("must be a whole number, found {}", kind(other)),
            range_hint(),
        )),
    }
}

/// A finite number of seconds, 0 or more (more than 0 when `positive`), at most a year.
pub(crate) fn seconds(value: &Value, at: &At, positive: bool) -> Result<f64, SpecError> {
    let hint = if positive {
        "a number of seconds greater than 0, e.g. 15"
    } else {
        "a number of seconds, 0 or more, e.g. 30"
    };
    let Value::Number(n) = value else {
        return Err(at.fix(format!("must be a number, found {}", kind(value)), hint));
    };
    let v = n.as_f64().unwrap_or(f64::NAN);
    let ok = v.is_finite() && v <= MAX_SECONDS && if positive { v > 0.0 } else { v >= 0.0 };
    if ok {
        Ok(v)
    } else {
        Err(at.fix(format!("{n} is not a usable number of seconds"), hint))
    }
}

/// A year: longer waits are typing mistakes.
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// The allowed word nearest to `word`, if it is a likely typo of it.
fn closest<'a>(word: &str, allowed: &[&'a str]) -> Option<&'a str> {
    allowed
        .iter()
        .map(|candidate| (edit_distance(word, candidate), *candidate))
        .filter(|(d, candidate)| *d <= 2 && *d < candidate.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut previous = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let current = row[j + 1];
            row[j + 1] = if ca == *cb {
                previous
            } else {
                1 + previous.min(row[j]).min(row[j + 1])
            };
            previous = current;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_near_keys_only() {
        assert_eq!(closest("cpu", &["cpus", "memory"]), Some("cpus"));
        assert_eq!(closest("memroy", &["cpus", "memory"]), Some("memory"));
        assert_eq!(closest("zzzzzz", &["cpus", "memory"]), None);
        assert_eq!(edit_distance("", "ab"), 2);
    }
}
