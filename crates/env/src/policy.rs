//! Simple policies that drive any environment from its action JSON Schema, for smoke
//! tests (`agentstack env run`) and conformance checks.
//!
//! - [`Policy::Random`]: a random value that fits the schema (enums, ranges, required
//!   fields), using hints from the last observation where they exist (a
//!   `legal_columns` or `legal_actions` list is sampled from).
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

/// Chooses an action for `schema` given the last `observation`.
pub fn choose(
    policy: Policy,
    schema: &Value,
    observation: &Map<String, Value>,
    rng: &mut impl Rng,
) -> Value {
    let mut action = value_for(policy, schema, schema, rng, 0);
    // Hints: sample a legal move when the observation lists them.
    for (hint, field) in [("legal_columns", "column"), ("legal_actions", "action")] {
        if let (Some(Value::Array(options)), Some(obj)) =
            (observation.get(hint), action.as_object_mut())
            && obj.contains_key(field)
        {
            let pick = match policy {
                Policy::Random => options.choose(rng).cloned(),
                Policy::Scripted => options.first().cloned(),
            };
            if let Some(pick) = pick {
                obj.insert(field.to_owned(), pick);
            }
        }
    }
    action
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
