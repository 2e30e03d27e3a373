//! What the request builders share: their error, shell quoting, and a component's
//! whole environment (its `envs` plus the discovery variables).

use std::collections::BTreeMap;

use crate::discovery::DiscoveryError;
use crate::spec::{JobGroup, Task};

/// Why a backend request could not be built from a valid spec.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The group has no component of that name.
    #[error("there is no component named `{component}`\nhint: the components are: {known}")]
    UnknownComponent {
        /// The name asked for.
        component: String,
        /// The group's components, comma-separated.
        known: String,
    },
    /// The replica asked for is past the component's replicas.
    #[error("component `{component}` has {replicas} replica(s); there is no replica {replica}")]
    NoSuchReplica {
        /// The component.
        component: String,
        /// The index asked for.
        replica: u32,
        /// How many it has.
        replicas: u32,
    },
    /// A variable declared with no value (`KEY: null`) was never given one.
    #[error(
        "component `{component}`: `envs.{key}` has no value\nhint: give it one in the spec, or at launch with --env {key}=VALUE"
    )]
    UnsetEnv {
        /// The component.
        component: String,
        /// The variable.
        key: String,
    },
    /// The spec asks for something this backend cannot do.
    #[error("component `{component}`: {what} is not supported on {backend}\nhint: {hint}")]
    Unsupported {
        /// `slurm`, `ray` or `kubernetes`.
        backend: &'static str,
        /// The component.
        component: String,
        /// What.
        what: String,
        /// What to do instead.
        hint: String,
    },
    /// The discovery variables could not be made.
    #[error("service discovery")]
    Discovery(#[source] DiscoveryError),
}

impl From<DiscoveryError> for BuildError {
    fn from(e: DiscoveryError) -> Self {
        Self::Discovery(e)
    }
}

/// The component named `name`.
pub(crate) fn component<'a>(group: &'a JobGroup, name: &str) -> Result<&'a Task, BuildError> {
    group
        .component(name)
        .ok_or_else(|| BuildError::UnknownComponent {
            component: name.to_owned(),
            known: group.component_names().join(", "),
        })
}

/// Checks `replica` against the component's replicas.
pub(crate) fn check_replica(task: &Task, replica: u32) -> Result<(), BuildError> {
    if replica >= task.replicas {
        return Err(BuildError::NoSuchReplica {
            component: task.name.clone(),
            replica,
            replicas: task.replicas,
        });
    }
    Ok(())
}

/// The task's own `envs` (every one must have a value by now) with `discovery` over
/// them; the spec keeps the two sets of names apart.
pub fn environment(
    task: &Task,
    discovery: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, BuildError> {
    let mut env = BTreeMap::new();
    for (key, value) in &task.envs {
        let value = value.clone().ok_or_else(|| BuildError::UnsetEnv {
            component: task.name.clone(),
            key: key.clone(),
        })?;
        env.insert(key.clone(), value);
    }
    env.extend(discovery.iter().map(|(k, v)| (k.clone(), v.clone())));
    Ok(env)
}

/// `text` as one shell word: as it is when that is safe, else in single quotes.
pub fn shell_quote(text: &str) -> String {
    let safe = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=@%+,".contains(c));
    if safe {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// A path for the node's shell: `~/x` becomes `"$HOME"/x`, anything else is quoted.
pub(crate) fn shell_path(path: &str) -> String {
    match path.strip_prefix("~/") {
        Some(rest) => format!("\"$HOME\"/{}", shell_quote(rest)),
        None if path == "~" => "\"$HOME\"".to_owned(),
        None => shell_quote(path),
    }
}

/// A job name: `<group>-<component>`, with `-<replica>` for replicated components.
pub(crate) fn instance_name(group: &JobGroup, task: &Task, replica: u32) -> String {
    if task.replicas > 1 {
        format!("{}-{}-{replica}", group.name, task.name)
    } else {
        format!("{}-{}", group.name, task.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc-1.2/x"), "abc-1.2/x");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("$HOME"), "'$HOME'");
        assert_eq!(shell_path("~/data dir"), "\"$HOME\"/'data dir'");
        assert_eq!(shell_path("/abs"), "/abs");
    }
}
