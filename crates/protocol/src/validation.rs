//! Pydantic-shaped validation errors.
//!
//! OpenEnv reports invalid input as a list of pydantic error dicts
//! (`{"type","loc","msg","input"}`), both in WebSocket `VALIDATION_ERROR` frames and in
//! HTTP `422` bodies. Python clients and users read these, so we produce the same shape.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One element of a location path: an object key or an array index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LocPart {
    /// An array index.
    Index(usize),
    /// An object key.
    Key(String),
}

impl From<&str> for LocPart {
    fn from(key: &str) -> Self {
        LocPart::Key(key.to_owned())
    }
}

/// One validation problem, shaped like a pydantic error dict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidationIssue {
    /// Machine-readable kind, e.g. `missing`, `extra_forbidden`, `string_type`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Where in the input the problem is.
    pub loc: Vec<LocPart>,
    /// What was wrong, for people.
    pub msg: String,
    /// The offending input, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Value>,
}

impl ValidationIssue {
    /// A new issue at `loc`.
    pub fn new(kind: &str, loc: Vec<LocPart>, msg: impl Into<String>) -> Self {
        Self {
            kind: kind.to_owned(),
            loc,
            msg: msg.into(),
            input: None,
        }
    }

    /// The same issue, carrying the offending input.
    pub fn with_input(mut self, input: Value) -> Self {
        self.input = Some(input);
        self
    }

    /// A required field is absent.
    pub fn missing(loc: Vec<LocPart>) -> Self {
        Self::new("missing", loc, "Field required")
    }

    /// A key that the model forbids.
    pub fn extra_forbidden(loc: Vec<LocPart>, input: Value) -> Self {
        Self::new("extra_forbidden", loc, "Extra inputs are not permitted").with_input(input)
    }

    /// The same issue with `prefix` put before its location.
    pub fn under(mut self, prefix: &[LocPart]) -> Self {
        let mut loc = prefix.to_vec();
        loc.append(&mut self.loc);
        self.loc = loc;
        self
    }

    /// A one-line human summary: `loc.path: msg`.
    pub fn summary(&self) -> String {
        if self.loc.is_empty() {
            return self.msg.clone();
        }
        let path: Vec<String> = self
            .loc
            .iter()
            .map(|part| match part {
                LocPart::Index(i) => i.to_string(),
                LocPart::Key(k) => k.clone(),
            })
            .collect();
        format!("{}: {}", path.join("."), self.msg)
    }
}

/// Joins the summaries of `issues` with `; `.
pub fn summarize(issues: &[ValidationIssue]) -> String {
    issues
        .iter()
        .map(ValidationIssue::summary)
        .collect::<Vec<_>>()
        .join("; ")
}
