//! The built-in environments, ready to serve:
//!
//! | name | what the agent does |
//! |---|---|
//! | [`echo`] | sends messages that come straight back (OpenEnv's template environment, with MCP tools) |
//! | [`arithmetic`] | solves generated arithmetic and word problems, answering in free text |
//! | [`connect_four`] | plays Connect Four against an opponent of adjustable strength |
//! | [`word_guess`] | finds a five-letter word from per-letter feedback, Wordle-style |
//! | [`coding`] | writes code (a function, or a fix to a small repository) that passes hidden tests run in a sandbox |
//!
//! Each is deterministic given the reset seed (and draws a seed when given none, which
//! its state reports), takes its settings as reset options, documents its action,
//! observation and reward in its `readme`, and derives its JSON Schemas from its types.
//!
//! ```
//! use agentstack_envs::{builtin, find};
//!
//! let names: Vec<_> = builtin().iter().map(|spec| spec.name().to_owned()).collect();
//! assert_eq!(names, ["echo", "arithmetic", "connect_four", "word_guess", "coding"]);
//!
//! let spec = find("connect_four").expect("built in");
//! assert_eq!(spec.info().reward_range, (-1.0, 1.0));
//! let session = spec.instantiate().expect("built-in environments always start");
//! # drop(session);
//! ```

pub mod arithmetic;
pub mod coding;
pub mod connect_four;
pub mod echo;
mod episode;
pub mod word_guess;
pub mod words;

use agentstack_env::EnvSpec;

/// The specs of every built-in environment: echo, arithmetic, connect_four,
/// word_guess, coding.
pub fn builtin() -> Vec<EnvSpec> {
    vec![
        echo::spec(),
        arithmetic::spec(),
        connect_four::spec(),
        word_guess::spec(),
        coding::spec(),
    ]
}

/// The spec of the built-in environment called `name`.
pub fn find(name: &str) -> Option<EnvSpec> {
    match name {
        echo::NAME => Some(echo::spec()),
        arithmetic::NAME => Some(arithmetic::spec()),
        connect_four::NAME => Some(connect_four::spec()),
        word_guess::NAME => Some(word_guess::spec()),
        coding::NAME => Some(coding::spec()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_knows_every_builtin() {
        for spec in builtin() {
            let found = find(spec.name()).expect("findable");
            assert_eq!(found.name(), spec.name());
            let info = spec.info();
            assert!(!info.description.is_empty());
            assert!(info.readme.as_deref().is_some_and(|r| r.starts_with("# ")));
            let (low, high) = info.reward_range;
            assert!(low < high);
        }
        assert!(find("chess").is_none());
    }

    #[test]
    fn schemas_describe_every_field() {
        for spec in builtin() {
            let schema = spec.schema();
            for (kind, schema) in [
                ("action", &schema.action),
                ("observation", &schema.observation),
            ] {
                let properties = schema["properties"].as_object().expect("object schema");
                for (field, property) in properties {
                    assert!(
                        property.get("description").is_some(),
                        "{}: {kind} field `{field}` has no description",
                        spec.name()
                    );
                }
            }
        }
    }
}
