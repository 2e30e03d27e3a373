//! What can be wrong with a spec, and where.

use std::fmt;

/// Where in a spec file a problem is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The document, counted from 1 (a job group's header is document 1).
    pub document: usize,
    /// The component the document describes, once its `name` is known.
    pub component: Option<String>,
    /// The key path inside the document (`resources.ports[1]`); empty for the whole document.
    pub path: String,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {}", self.document)?;
        if let Some(component) = &self.component {
            write!(f, " (component `{component}`)")?;
        }
        if !self.path.is_empty() {
            write!(f, ", `{}`", self.path)?;
        }
        Ok(())
    }
}

/// What can go wrong reading a task or job group YAML.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The text is not YAML.
    #[error("document {document} is not valid YAML")]
    Yaml {
        /// The document, counted from 1.
        document: usize,
        /// The parser's error (it names the line and column).
        #[source]
        source: serde_norway::Error,
    },
    /// The file holds no document.
    #[error("the file is empty\nhint: a task needs at least `name` and `run`")]
    Empty,
    /// The file is larger than a spec can be.
    #[error("the file is {size} bytes; a spec may be at most {limit} bytes")]
    TooLarge {
        /// Its size.
        size: usize,
        /// [`super::MAX_SPEC_BYTES`].
        limit: usize,
    },
    /// A key or a value is wrong.
    #[error("{location}: {message}{}", hint_line(.hint))]
    Invalid {
        /// Where.
        location: Location,
        /// What is wrong.
        message: String,
        /// How to fix it.
        hint: Option<String>,
    },
}

fn hint_line(hint: &Option<String>) -> String {
    hint.as_ref()
        .map(|h| format!("\nhint: {h}"))
        .unwrap_or_default()
}

impl SpecError {
    /// Where the problem is, when it is about a key or value.
    pub fn location(&self) -> Option<&Location> {
        match self {
            Self::Invalid { location, .. } => Some(location),
            _ => None,
        }
    }
}
