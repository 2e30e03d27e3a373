//! Simple policies that drive any environment from its action JSON Schema, for smoke
//! tests (`agentstack env run`) and conformance checks.
//!
//! - [`Policy::Random`]: a random value that fits the schema (enums, ranges, required
//!   fields). When the last observation lists the legal moves (`legal_actions`,
//!   `legal_moves`, `available_actions`, `valid_actions`, `legal_columns`), the action
//!   field ([`action_field`]: `action`, `action_id`, or the one required integer or
//!   enum field, as in OpenEnv's atari and openspiel) is drawn from that list.
//! - [`Policy::Scripted`]: the same, deterministic: the first choice everywhere.

use rand::Rng;
use rand::seq::IndexedRandom;
use serde_json::{Map, Value, json};

/// How to choose actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Random values that fit the schema.
    Random,
    /// The first valid choice everywhere.
    Scripted,
}

const WORDS: [&str; 8] = [
    "hello", "crane", "42", "slate", "world", "7", "agent", "stack",
];

/// Observation fields that list the moves legal now, in the order they are looked for.
pub const LEGAL_MOVE_LISTS: [&str; 5] = [
    "legal_actions",
    "legal_moves",
    "available_actions",
    "valid_actions",
    "legal_columns",
];

/// Action fields that hold the move by name, in the order they are looked for.
const ACTION_FIELD_NAMES: [&str; 2] = ["action", "action_id"];

/// Chooses an action for `schema` given the last `observation`.
pub fn choose(
    policy: Policy,
    schema: &Value,
    observation: &Map<String, Value>,
    rng: &mut impl Rng,
) -> Value {
    let mut action = value_for(policy, schema, schema, rng, 0);
    // A move the environment says is legal beats any value the schema allows.
    if let Some((list, options)) = legal_moves(observation)
        && let Some(field) = listed_field(schema, list).or_else(|| action_field(schema))
        && let Some(obj) = action.as_object_mut()
    {
        let pick = match policy {
            Policy::Random => options.choose(rng),
            Policy::Scripted => options.first(),
        };
        if let Some(pick) = pick {
            obj.insert(field, pick.clone());
        }
    }
    action
}

/// The first non-empty list of legal moves in `observation` (see [`LEGAL_MOVE_LISTS`]),
/// with its name.
pub fn legal_moves(observation: &Map<String, Value>) -> Option<(&'static str, &[Value])> {
    LEGAL_MOVE_LISTS
        .iter()
        .find_map(|name| match observation.get(*name) {
            Some(Value::Array(options)) if !options.is_empty() => Some((*name, options.as_slice())),
            _ => None,
        })
}

/// The action field a list of legal moves names: `legal_columns` fills `column`, when
/// the schema has one.
fn listed_field(schema: &Value, list: &str) -> Option<String> {
    let noun = list.split_once('_')?.1;
    let field = noun.strip_suffix('s').unwrap_or(noun);
    resolve(schema, schema)
        .pointer(&format!("/properties/{field}"))
        .map(|_| field.to_owned())
}

/// The field of an action object that holds the move: `action` or `action_id` when the
/// schema has one; otherwise the only required field that is an integer or an enum
/// (connect four's `column`); otherwise the only required field. `None` when the
/// schema is not an object or the move field is ambiguous.
pub fn action_field(schema: &Value) -> Option<String> {
    let object = resolve(schema, schema);
    let Some(Value::Object(properties)) = object.get("properties") else {
        return None;
    };
    if let Some(name) = ACTION_FIELD_NAMES
        .iter()
        .find(|name| properties.contains_key(**name))
    {
        return Some((*name).to_owned());
    }
    let required: Vec<&str> = object
        .get("required")
        .and_then(Value::as_array)
        .map(|r| {
            r.iter()
                .filter_map(Value::as_str)
                .filter(|name| properties.contains_key(*name))
                .collect()
        })
        .unwrap_or_default();
    let choice_like: Vec<&str> = required
        .iter()
        .copied()
        .filter(|name| is_integer_or_enum(schema, &properties[*name]))
        .collect();
    match (choice_like.as_slice(), required.as_slice()) {
        ([only], _) | ([], [only]) => Some((*only).to_owned()),
        _ => None,
    }
}

/// Whether a property takes an integer or one of an enumeration (through `$ref`,
/// and through `anyOf`/`oneOf` with `null`, as optional fields are written).
fn is_integer_or_enum(root: &Value, property: &Value) -> bool {
    let property = resolve(root, property);
    if property.get("enum").is_some() {
        return true;
    }
    match property.get("type") {
        Some(Value::String(t)) => return t == "integer",
        Some(Value::Array(ts)) => return ts.iter().any(|t| t == "integer"),
        _ => {}
    }
    ["anyOf", "oneOf"].iter().any(|key| {
        property
            .get(*key)
            .and_then(Value::as_array)
            .is_some_and(|options| options.iter().any(|o| is_integer_or_enum(root, o)))
    })
}

fn resolve<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    if let Some(Value::String(r)) = schema.get("$ref") {
        let path = r.trim_start_matches("#/");
        let mut node = root;
        for part in path.split('/') {
            match node.get(part) {
                Some(next) => node = next,
                None => return schema,
            }
        }
        return node;
    }
    schema
}

fn value_for(
    policy: Policy,
    root: &Value,
    schema: &Value,
    rng: &mut impl Rng,
    depth: usize,
) -> Value {
    let schema = resolve(root, schema);
    if depth > 8 {
        return Value::Null;
    }
    if let Some(Value::Array(options)) = schema.get("enum") {
        return match policy {
            Policy::Random => options.choose(rng).cloned().unwrap_or(Value::Null),
            Policy::Scripted => options.first().cloned().unwrap_or(Value::Null),
        };
    }
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(Value::Array(options)) = schema.get(key) {
            let non_null: Vec<&Value> = options
                .iter()
                .filter(|o| o.get("type") != Some(&json!("null")))
                .collect();
            let pick = match policy {
                Policy::Random => non_null.choose(rng).copied(),
                Policy::Scripted => non_null.first().copied(),
            };
            return pick.map_or(Value::Null, |s| value_for(policy, root, s, rng, depth + 1));
        }
    }
    let ty = match schema.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null"),
        _ if schema.get("properties").is_some() => "object",
        _ => "string",
    };
    match ty {
        "object" => {
            let mut out = Map::new();
            if let Some(Value::Object(props)) = schema.get("properties") {
                let required: Vec<&str> = schema
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                for (name, prop) in props {
                    if required.contains(&name.as_str())
                        || name != "metadata" && policy == Policy::Scripted
                    {
                        out.insert(name.clone(), value_for(policy, root, prop, rng, depth + 1));
                    }
                }
            }
            Value::Object(out)
        }
        "array" => {
            let n = match policy {
                Policy::Random => rng.random_range(0..3),
                Policy::Scripted => 1,
            };
            let items = schema.get("items").cloned().unwrap_or(json!({}));
            Value::Array(
                (0..n)
                    .map(|_| value_for(policy, root, &items, rng, depth + 1))
                    .collect(),
            )
        }
        "integer" => {
            let lo = schema.get("minimum").and_then(Value::as_i64).unwrap_or(0);
            let hi = schema
                .get("maximum")
                .and_then(Value::as_i64)
                .unwrap_or(lo + 9)
                .max(lo);
            match policy {
                Policy::Random => json!(rng.random_range(lo..=hi)),
                Policy::Scripted => json!(lo),
            }
        }
        "number" => {
            let lo = schema.get("minimum").and_then(Value::as_f64).unwrap_or(0.0);
            let hi = schema
                .get("maximum")
                .and_then(Value::as_f64)
                .unwrap_or(lo + 1.0)
                .max(lo);
            match policy {
                Policy::Random => json!(rng.random_range(lo..=hi)),
                Policy::Scripted => json!(lo),
            }
        }
        "boolean" => json!(policy == Policy::Random && rng.random_bool(0.5)),
        "null" => Value::Null,
        _ => match policy {
            Policy::Random => json!(WORDS.choose(rng).copied().unwrap_or("hello")),
            Policy::Scripted => json!("hello"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn fills_required_fields_and_follows_hints() {
        let schema = json!({
            "type":"object","required":["column","mode"],
            "properties":{"column":{"type":"integer","minimum":0,"maximum":6},
                          "mode":{"$ref":"#/$defs/Mode"}},
            "$defs":{"Mode":{"enum":["a","b"]}}
        });
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..20 {
            let a = choose(Policy::Random, &schema, &Map::new(), &mut rng);
            let c = a["column"].as_i64().unwrap();
            assert!((0..=6).contains(&c));
            assert!(a["mode"] == "a" || a["mode"] == "b");
        }
        let obs = json!({"legal_columns":[4]}).as_object().unwrap().clone();
        assert_eq!(choose(Policy::Random, &schema, &obs, &mut rng)["column"], 4);
        let s = choose(Policy::Scripted, &schema, &Map::new(), &mut rng);
        assert_eq!(s, json!({"column":0,"mode":"a"}));
    }

    /// Regression (issue 20): OpenEnv's atari and openspiel name the move `action_id`
    /// and list the legal ones in `legal_actions`; the random policy drew any integer
    /// and atari stopped on "Invalid action_id".
    #[test]
    fn picks_legal_moves_whatever_the_action_field_is_called() {
        let atari = json!({
            "type":"object","required":["action_id"],
            "properties":{"action_id":{"type":"integer","title":"Action Id"},
                          "game_name":{"type":"string","default":"pong"},
                          "metadata":{"type":"object"}}
        });
        let single_enum = json!({
            "type":"object","required":["label","choice"],
            "properties":{"label":{"type":"string"},"choice":{"$ref":"#/$defs/Choice"}},
            "$defs":{"Choice":{"enum":["x","y","z"]}}
        });
        let single_string = json!({
            "type":"object","required":["move"],"properties":{"move":{"type":"string"}}
        });
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (schema, list, legal, field) in [
            (&atari, "legal_actions", json!([11, 17]), "action_id"),
            (&atari, "available_actions", json!([13]), "action_id"),
            (&atari, "valid_actions", json!([12, 14]), "action_id"),
            (&single_enum, "legal_moves", json!(["y"]), "choice"),
            (
                &single_string,
                "legal_moves",
                json!(["e2e4", "d2d4"]),
                "move",
            ),
        ] {
            let observation = json!({ list: legal }).as_object().unwrap().clone();
            for policy in [Policy::Random, Policy::Scripted] {
                for _ in 0..20 {
                    let action = choose(policy, schema, &observation, &mut rng);
                    assert!(
                        legal.as_array().unwrap().contains(&action[field]),
                        "{policy:?} chose {action} from {list} {legal}"
                    );
                }
            }
        }
        // An empty list (the game is over) is no hint.
        let over = json!({"legal_actions": []}).as_object().unwrap().clone();
        assert!(choose(Policy::Random, &atari, &over, &mut rng)["action_id"].is_i64());
    }

    #[test]
    fn the_action_field_comes_from_the_schema() {
        let field = |schema: Value| action_field(&schema);
        assert_eq!(
            field(
                json!({"properties":{"action":{"type":"string"},"n":{"type":"integer"}},"required":["n"]})
            ),
            Some("action".into())
        );
        assert_eq!(
            field(json!({"properties":{"column":{"type":"integer"}},"required":["column"]})),
            Some("column".into())
        );
        // Optional fields written as anyOf with null still count as integers.
        assert_eq!(
            field(json!({"required":["a","b"],"properties":{
                "a":{"type":"string"},"b":{"anyOf":[{"type":"integer"},{"type":"null"}]}}})),
            Some("b".into())
        );
        // Two integer fields: ambiguous.
        assert_eq!(
            field(json!({"required":["x","y"],"properties":{
                "x":{"type":"integer"},"y":{"type":"integer"}}})),
            None
        );
        assert_eq!(field(json!({"type":"string"})), None);
    }
}

/// Whether an action schema is OpenEnv's MCP `CallToolAction` (a `tool_name` field):
/// such environments are driven by calling their tools.
pub fn is_tool_call_schema(schema: &Value) -> bool {
    schema.pointer("/properties/tool_name").is_some()
}

/// A `call_tool` step action: one of `tools`, with arguments that fit its schema.
pub fn choose_tool_call(
    policy: Policy,
    tools: &[agentstack_protocol::mcp::StepTool],
    rng: &mut impl Rng,
) -> Option<Value> {
    let tool = match policy {
        Policy::Random => tools.choose(rng)?,
        Policy::Scripted => tools.first()?,
    };
    let arguments = value_for(policy, &tool.input_schema, &tool.input_schema, rng, 0);
    Some(json!({"type": "call_tool", "tool_name": tool.name, "arguments": arguments}))
}

#[cfg(test)]
mod tool_tests {
    use super::*;
    use agentstack_protocol::mcp::StepTool;
    use rand::SeedableRng;

    #[test]
    fn tool_calls_fit_the_tool_schema() {
        let tools = vec![StepTool {
            name: "echo_message".into(),
            description: String::new(),
            input_schema: json!({"type":"object","required":["message"],"properties":{"message":{"type":"string"}}}),
        }];
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let call = choose_tool_call(Policy::Random, &tools, &mut rng).unwrap();
        assert_eq!(call["tool_name"], "echo_message");
        assert!(call["arguments"]["message"].is_string());
        assert!(is_tool_call_schema(
            &json!({"properties":{"tool_name":{"type":"string"}}})
        ));
        assert!(choose_tool_call(Policy::Random, &[], &mut rng).is_none());
    }
}
