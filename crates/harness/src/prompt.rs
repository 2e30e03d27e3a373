//! From observations to messages, and from the model's reply to an action.
//!
//! A [`Profile`] says how one environment is presented: a system prompt and a user
//! template (minijinja, over `observation` and `env`), and how a reply becomes an
//! action. Built-in environments have tuned profiles ([`Profile::builtin`]); any other
//! environment gets a generic one derived from its action schema
//! ([`Profile::generic`]), and users can write their own (TOML or JSON of the same
//! fields).
//!
//! Replies become actions in one of three ways ([`ActionFormat`]):
//!
//! - **text**: the action has one string field; the reply (reasoning blocks removed,
//!   or the last match of `answer_pattern`) goes into it;
//! - **json**: the reply must contain a JSON object that is the action; a reply that
//!   is only a number answers an action with a single integer field;
//! - **tools**: the environment is driven by MCP tools (`call_tool` actions); the
//!   model's first tool call is the action.

use agentstack_model::chat::ToolCall;
use agentstack_protocol::mcp::StepTool;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// How a reply becomes an action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ActionFormat {
    /// The reply's text goes into the one string field `field`.
    Text {
        /// The action's string field.
        field: String,
    },
    /// The reply holds a JSON object that is the action.
    Json,
    /// The model calls the environment's MCP tools.
    Tools,
}

impl ActionFormat {
    /// The format an action schema asks for: tools when the environment takes
    /// `call_tool` actions and has tools, text when the action is one required string
    /// field, JSON otherwise.
    pub fn for_schema(action_schema: &Value, tools: &[StepTool]) -> Self {
        if agentstack_env::policy::is_tool_call_schema(action_schema) && !tools.is_empty() {
            return Self::Tools;
        }
        let properties = action_schema
            .get("properties")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let required: Vec<&str> = action_schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let candidates: Vec<&String> = properties
            .keys()
            .filter(|k| required.is_empty() || required.contains(&k.as_str()))
            .collect();
        if let [field] = candidates.as_slice()
            && properties[field.as_str()]
                .get("type")
                .and_then(Value::as_str)
                == Some("string")
            && (required.len() <= 1)
        {
            return Self::Text {
                field: (*field).clone(),
            };
        }
        Self::Json
    }
}

/// How one environment is presented to the model. Recorded (as a hash) with every
/// result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The system prompt (minijinja; sees `env`, `action_schema`).
    pub system: String,
    /// The user message made from an observation (minijinja; sees `observation`,
    /// `env`).
    pub user: String,
    /// How the reply becomes an action; derived from the action schema when absent.
    #[serde(default)]
    pub action: Option<ActionFormat>,
    /// For text actions: a regular expression whose last match in the reply is the
    /// answer (its first group, if it has one); the whole reply when absent or
    /// unmatched.
    #[serde(default)]
    pub answer_pattern: Option<String>,
}

/// Observation fields never shown to the model.
const HIDDEN_FIELDS: [&str; 3] = ["metadata", "reward", "done"];

impl Profile {
    /// The tuned profile of a built-in environment, if `env` is one.
    pub fn builtin(env: &str) -> Option<Self> {
        if env == "coding" {
            // One fenced block of Python becomes `solution.py`, submitted at once (the
            // HumanEval way); multi-step repository work takes the JSON or tool forms.
            return Some(Self {
                system: "You are an expert Python programmer. Write the complete solution.py the task asks for, in one ```python code block.".into(),
                user: "{{ observation.prompt }}{% if observation.output %}\n\n{{ observation.output }}{% endif %}".into(),
                action: Some(ActionFormat::Text {
                    field: "code".into(),
                }),
                answer_pattern: Some(r"(?s)```(?:python|py)?[ \t]*\n(.*?)```".into()),
            });
        }
        let (system, user, pattern) = match env {
            "arithmetic" => (
                "Solve the math problem. Think step by step, then end with: The answer is N.",
                "{{ observation.problem }}{% if observation.feedback %}\n\n{{ observation.feedback }} Attempts left: {{ observation.attempts_left }}.{% endif %}",
                None,
            ),
            "connect_four" => (
                "You play Connect Four as X against O. Discs drop to the lowest empty cell of a column; four in a row wins. Reply with only the JSON object {\"column\": N}, where N is one of the legal columns.",
                "{{ observation.message }}\n\n{{ observation.board_text }}\n\nLegal columns: {{ observation.legal_columns | join(\", \") }}",
                None,
            ),
            "word_guess" => (
                "Guess the secret five-letter English word. After each guess you get one mark per letter: G = right letter, right place; Y = in the word, elsewhere; . = not in the word. Reply with only your guess.",
                "{{ observation.message }}{% for h in observation.history %}\n{{ h.guess }} {{ h.feedback }}{% endfor %}\nGuesses left: {{ observation.guesses_left }}",
                Some(r"\b([A-Za-z]{5})\b"),
            ),
            "echo" => (
                "Reply with a short message.",
                "{% if observation.echoed_message %}The environment echoed: {{ observation.echoed_message }}{% else %}Say something.{% endif %}",
                None,
            ),
            _ => return None,
        };
        Some(Self {
            system: system.into(),
            user: user.into(),
            action: None,
            answer_pattern: pattern.map(str::to_owned),
        })
    }

    /// A profile for any environment: its description and the action's form as the
    /// system prompt, the observation's fields (`name: value`, one per line) as the
    /// user message.
    pub fn generic() -> Self {
        Self {
            system: "{{ env.description }}\n\n{{ env.instructions }}".into(),
            user: "{% for key, value in observation | items %}{% if value is not none %}{{ key }}: {{ value }}\n{% endif %}{% endfor %}"
                .into(),
            action: None,
            answer_pattern: None,
        }
    }

    /// The built-in profile of `env`, else the generic one.
    pub fn for_env(env: &str) -> Self {
        Self::builtin(env).unwrap_or_else(Self::generic)
    }

    /// A stable short hash of the profile, recorded with results.
    pub fn digest(&self) -> String {
        crate::stats::short_hash(&serde_json::to_string(self).unwrap_or_default())
    }
}

/// A profile compiled for one environment.
#[derive(Debug)]
pub struct Presenter {
    profile: Profile,
    format: ActionFormat,
    action_schema: Value,
    description: String,
    pattern: Option<regex::Regex>,
    tools: Vec<Value>,
}

/// A template or pattern that does not compile or render.
#[derive(Debug, thiserror::Error)]
#[error("prompt profile: {0}")]
pub struct ProfileError(String);

impl Presenter {
    /// Compiles `profile` for an environment with this description, action schema and
    /// tools.
    pub fn new(
        profile: Profile,
        description: &str,
        action_schema: &Value,
        tools: &[StepTool],
    ) -> Result<Self, ProfileError> {
        let format = profile
            .action
            .clone()
            .unwrap_or_else(|| ActionFormat::for_schema(action_schema, tools));
        let pattern = profile
            .answer_pattern
            .as_deref()
            .map(regex::Regex::new)
            .transpose()
            .map_err(|e| ProfileError(format!("answer_pattern: {e}")))?;
        let tools = if format == ActionFormat::Tools {
            tools
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.name, "description": t.description, "parameters": t.input_schema}})
                })
                .collect()
        } else {
            Vec::new()
        };
        let presenter = Self {
            profile,
            format,
            action_schema: action_schema.clone(),
            description: description.to_owned(),
            pattern,
            tools,
        };
        // Fail now, not mid-run, on a template that does not compile.
        presenter.system()?;
        presenter.user(&Map::new())?;
        Ok(presenter)
    }

    /// How replies become actions.
    pub fn format(&self) -> &ActionFormat {
        &self.format
    }

    /// The OpenAI tool definitions offered to the model (tools format only).
    pub fn tools(&self) -> &[Value] {
        &self.tools
    }

    /// The JSON Schema a constrained model must follow (json format only).
    pub fn json_schema(&self) -> Option<&Value> {
        (self.format == ActionFormat::Json).then_some(&self.action_schema)
    }

    /// What the action should look like, in words, for the system prompt and for
    /// feedback after a reply that could not be used.
    pub fn instructions(&self) -> String {
        match &self.format {
            ActionFormat::Text { .. } => "Answer in plain text.".into(),
            ActionFormat::Json => format!(
                "Reply with one JSON object that matches this JSON Schema: {}",
                compact_schema(&self.action_schema)
            ),
            ActionFormat::Tools => "Call one of the tools.".into(),
        }
    }

    fn render(
        &self,
        template: &str,
        observation: &Map<String, Value>,
    ) -> Result<String, ProfileError> {
        let mut env = minijinja::Environment::new();
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Chainable);
        let shown: Map<String, Value> = observation
            .iter()
            .filter(|(k, _)| !HIDDEN_FIELDS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let context = json!({
            "observation": shown,
            "env": {"description": self.description, "instructions": self.instructions()},
            "action_schema": self.action_schema,
        });
        env.render_str(template, context)
            .map(|s| s.trim().to_owned())
            .map_err(|e| ProfileError(format!("{e:#}")))
    }

    /// The system prompt.
    pub fn system(&self) -> Result<String, ProfileError> {
        self.render(&self.profile.system, &Map::new())
    }

    /// The user message for an observation.
    pub fn user(&self, observation: &Map<String, Value>) -> Result<String, ProfileError> {
        self.render(&self.profile.user, observation)
    }

    /// The action a reply stands for, or why it stands for none.
    pub fn parse(&self, text: &str, tool_calls: &[ToolCall]) -> Result<Value, String> {
        let text = strip_thinking(text);
        match &self.format {
            ActionFormat::Text { field } => {
                let answer = self
                    .pattern
                    .as_ref()
                    .and_then(|p| p.captures_iter(&text).last())
                    .map(|c| {
                        c.get(1)
                            .or_else(|| c.get(0))
                            .map_or("", |m| m.as_str())
                            .to_owned()
                    })
                    .unwrap_or_else(|| text.trim().to_owned());
                if answer.is_empty() {
                    return Err("the reply was empty".into());
                }
                let mut action = Map::new();
                action.insert(field.clone(), Value::String(answer));
                Ok(Value::Object(action))
            }
            ActionFormat::Json => json_action(&text, &self.action_schema),
            ActionFormat::Tools => {
                let call = tool_calls
                    .first()
                    .ok_or("the reply called no tool; call one of the tools")?;
                let arguments: Value =
                    serde_json::from_str(&call.function.arguments).map_err(|e| {
                        format!(
                            "the arguments of `{}` are not JSON: {e}",
                            call.function.name
                        )
                    })?;
                Ok(
                    json!({"type": "call_tool", "tool_name": call.function.name, "arguments": arguments}),
                )
            }
        }
    }
}

/// Removes `<think>…</think>` blocks (and an unclosed one at the end).
pub fn strip_thinking(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find("<think>") {
        out.push_str(&rest[..open]);
        match rest[open..].find("</think>") {
            Some(close) => rest = &rest[open + close + "</think>".len()..],
            None => {
                rest = "";
                break;
            }
        }
    }
    out.push_str(rest);
    out.trim().to_owned()
}

/// The schema without descriptions and titles, on one line: what a model needs.
fn compact_schema(schema: &Value) -> String {
    fn strip(v: &Value) -> Value {
        match v {
            Value::Object(m) => Value::Object(
                m.iter()
                    .filter(|(k, _)| !matches!(k.as_str(), "description" | "title" | "$schema"))
                    .map(|(k, v)| (k.clone(), strip(v)))
                    .collect(),
            ),
            Value::Array(a) => Value::Array(a.iter().map(strip).collect()),
            other => other.clone(),
        }
    }
    strip(schema).to_string()
}

/// The first JSON object in `text` (whole or inside a code fence or prose); a bare
/// integer answers a schema with one integer field.
fn json_action(text: &str, schema: &Value) -> Result<Value, String> {
    for (start, _) in text.match_indices('{') {
        let mut stream = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        if let Some(Ok(value @ Value::Object(_))) = stream.next() {
            return Ok(value);
        }
    }
    let integer_fields: Vec<&String> = schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| {
            p.iter()
                .filter(|(_, s)| s.get("type").and_then(Value::as_str) == Some("integer"))
                .map(|(k, _)| k)
                .collect()
        })
        .unwrap_or_default();
    let trimmed = text.trim().trim_end_matches('.');
    if let ([field], Ok(n)) = (integer_fields.as_slice(), trimmed.parse::<i64>()) {
        return Ok(json!({ field.as_str(): n }));
    }
    Err("the reply holds no JSON object".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentstack_model::chat::FunctionCall;

    fn schema_text() -> Value {
        json!({"type": "object", "properties": {"answer": {"type": "string", "description": "d"}}, "required": ["answer"]})
    }

    fn schema_column() -> Value {
        json!({"type": "object", "properties": {"column": {"type": "integer"}}, "required": ["column"]})
    }

    #[test]
    fn coding_replies_become_the_last_python_block() {
        let schema = json!({"type": "object", "properties": {"tool": {"type": "string"}, "code": {"type": "string"}}});
        let p = Presenter::new(Profile::builtin("coding").unwrap(), "", &schema, &[]).unwrap();
        let reply = "Here it is:\n```python\ndef f():\n    return 1\n```\nDone.";
        assert_eq!(
            p.parse(reply, &[]).unwrap(),
            json!({"code": "def f():\n    return 1\n"})
        );
        assert_eq!(
            p.parse("def g(): pass", &[]).unwrap(),
            json!({"code": "def g(): pass"})
        );
        let user = p
            .user(
                json!({"prompt": "Write f.", "output": ""})
                    .as_object()
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(user, "Write f.");
    }

    #[test]
    fn formats_follow_the_action_schema() {
        assert_eq!(
            ActionFormat::for_schema(&schema_text(), &[]),
            ActionFormat::Text {
                field: "answer".into()
            }
        );
        assert_eq!(
            ActionFormat::for_schema(&schema_column(), &[]),
            ActionFormat::Json
        );
        let tool = StepTool {
            name: "echo".into(),
            description: String::new(),
            input_schema: json!({"type": "object"}),
        };
        let call_tool = json!({"properties": {"tool_name": {"type": "string"}, "arguments": {}}});
        assert_eq!(
            ActionFormat::for_schema(&call_tool, &[tool]),
            ActionFormat::Tools
        );
    }

    #[test]
    fn replies_become_actions() {
        let p = Presenter::new(Profile::generic(), "d", &schema_column(), &[]).unwrap();
        assert_eq!(
            p.parse("I play {\"column\": 3} now", &[]).unwrap(),
            json!({"column": 3})
        );
        assert_eq!(
            p.parse("```json\n{\"column\": 4}\n```", &[]).unwrap(),
            json!({"column": 4})
        );
        assert_eq!(p.parse(" 5.", &[]).unwrap(), json!({"column": 5}));
        assert!(p.parse("the middle one", &[]).is_err());

        let word = Presenter::new(Profile::builtin("word_guess").unwrap(), "", &json!({"type": "object", "properties": {"guess": {"type": "string"}}, "required": ["guess"]}), &[]).unwrap();
        assert_eq!(
            word.parse("<think>hmm</think>My guess is CRANE", &[])
                .unwrap(),
            json!({"guess": "CRANE"})
        );

        let tool = StepTool {
            name: "echo_message".into(),
            description: String::new(),
            input_schema: json!({"type": "object"}),
        };
        let tools = Presenter::new(
            Profile::generic(),
            "",
            &json!({"properties": {"tool_name": {}}}),
            &[tool],
        )
        .unwrap();
        let call = ToolCall {
            id: "c".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "echo_message".into(),
                arguments: "{\"message\": \"hi\"}".into(),
            },
        };
        assert_eq!(
            tools.parse("", &[call]).unwrap(),
            json!({"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "hi"}})
        );
        assert!(tools.parse("no call", &[]).is_err());
    }

    #[test]
    fn thinking_is_stripped() {
        assert_eq!(strip_thinking("<think>a</think>b<think>c</think> d"), "b d");
        assert_eq!(strip_thinking("x <think>unfinished"), "x");
    }

    #[test]
    fn templates_render_observations_and_bad_ones_fail_early() {
        let p = Presenter::new(Profile::for_env("arithmetic"), "", &schema_text(), &[]).unwrap();
        let obs = json!({"problem": "What is 2 + 2?", "feedback": null, "attempts_left": 1, "metadata": {}});
        assert_eq!(p.user(obs.as_object().unwrap()).unwrap(), "What is 2 + 2?");
        let generic = Presenter::new(Profile::generic(), "Add.", &schema_text(), &[]).unwrap();
        assert_eq!(
            generic.user(obs.as_object().unwrap()).unwrap(),
            "problem: What is 2 + 2?\nattempts_left: 1"
        );
        assert!(
            generic
                .system()
                .unwrap()
                .starts_with("Add.\n\nAnswer in plain text.")
        );
        let bad = Profile {
            user: "{% for %}".into(),
            ..Profile::generic()
        };
        assert!(Presenter::new(bad, "", &schema_text(), &[]).is_err());
    }
}
