//! What every built-in environment does at reset: seed its random number generator
//! and read typed reset options, with errors that name the option and its allowed
//! values.

use std::ops::RangeInclusive;

use agentstack_env::EnvError;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{Map, Value};

/// The error returned by `step` once an episode has ended.
pub(crate) const EPISODE_OVER: &str = "episode is over; call reset";

/// The error returned by `step` before the first `reset`.
pub(crate) const NO_EPISODE: &str = "no episode yet; call reset first";

/// The seed an episode runs with and its generator. Without a seed a random one is
/// drawn, so the episode can still be replayed from the seed the state reports.
pub(crate) fn episode_rng(seed: Option<u64>) -> (u64, ChaCha8Rng) {
    let seed = seed.unwrap_or_else(rand::random);
    (seed, ChaCha8Rng::seed_from_u64(seed))
}

/// Reads the integer option `key`, `default` when absent or `null`.
pub(crate) fn int_option(
    options: &Map<String, Value>,
    key: &str,
    default: u64,
    allowed: RangeInclusive<u64>,
) -> Result<u64, EnvError> {
    let value = match options.get(key) {
        None | Some(Value::Null) => return Ok(default),
        Some(value) => value,
    };
    match value.as_u64() {
        Some(n) if allowed.contains(&n) => Ok(n),
        _ => Err(EnvError::new(format!(
            "invalid reset option `{key}`: expected an integer from {} to {}, got {value}",
            allowed.start(),
            allowed.end()
        ))),
    }
}

/// Reads the boolean option `key`, `default` when absent or `null`.
pub(crate) fn bool_option(
    options: &Map<String, Value>,
    key: &str,
    default: bool,
) -> Result<bool, EnvError> {
    match options.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(EnvError::new(format!(
            "invalid reset option `{key}`: expected true or false, got {other}"
        ))),
    }
}

/// Reset arguments for tests: a seed and an options object.
#[cfg(test)]
pub(crate) fn test_reset_args(seed: u64, options: Value) -> agentstack_env::ResetArgs {
    let Value::Object(options) = options else {
        unreachable!("tests pass objects")
    };
    agentstack_env::ResetArgs {
        seed: Some(seed),
        episode_id: "test".into(),
        options,
    }
}

#[cfg(test)]
mod tests {
    use rand::Rng;
    use serde_json::json;

    use super::*;

    fn options(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!("tests pass objects"),
        }
    }

    #[test]
    fn int_option_defaults_and_checks_range() {
        let opts = options(json!({"level": 3, "big": 9, "text": "3", "neg": -1, "null": null}));
        assert_eq!(int_option(&opts, "missing", 1, 1..=5), Ok(1));
        assert_eq!(int_option(&opts, "null", 2, 1..=5), Ok(2));
        assert_eq!(int_option(&opts, "level", 1, 1..=5), Ok(3));
        for key in ["big", "text", "neg"] {
            let err = int_option(&opts, key, 1, 1..=5).unwrap_err();
            assert!(err.message.contains("from 1 to 5"), "{err}");
            assert!(err.message.contains(key), "{err}");
        }
    }

    #[test]
    fn bool_option_rejects_non_booleans() {
        let opts = options(json!({"on": true, "text": "yes"}));
        assert_eq!(bool_option(&opts, "on", false), Ok(true));
        assert_eq!(bool_option(&opts, "missing", true), Ok(true));
        let err = bool_option(&opts, "text", true).unwrap_err();
        assert!(err.message.contains("true or false"), "{err}");
    }

    #[test]
    fn same_seed_same_stream() {
        let (seed, mut a) = episode_rng(Some(7));
        let (_, mut b) = episode_rng(Some(7));
        assert_eq!(seed, 7);
        assert_eq!(a.random::<u64>(), b.random::<u64>());
    }
}
