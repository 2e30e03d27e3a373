//! Chat templates: the model's own Jinja template from its metadata, rendered with
//! minijinja (Python string methods included), or ChatML when the model has none.

use agentstack_static::with_causes;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::error::{ModelError, Result};

/// ChatML, the fallback when a model ships no template. Tools, when given, are described
/// in a system block the way Hermes/Qwen-style templates do.
pub const CHATML: &str = r#"{%- if tools %}<|im_start|>system
{% if messages[0].role == "system" %}{{ messages[0].content }}

{% endif %}You may call one or more functions to assist with the user query. You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif -%}
{%- for message in messages %}
{%- if not (tools and loop.first and message.role == "system") -%}
{%- if message.role == "tool" -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endif -%}
{%- endif -%}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

/// One message of a conversation, as the OpenAI API and chat templates see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (null for an assistant turn that only calls tools).
    #[serde(default)]
    pub content: Option<String>,
    /// Tool calls made by an assistant turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For `tool` messages: the call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An optional name of the author.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    /// A message with text content.
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.to_owned(),
            content: Some(content.into()),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A call of a tool by the model, in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// What is called.
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// The function part of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// The arguments, as a JSON text (OpenAI sends a string).
    pub arguments: String,
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos: String,
    eos: String,
    is_fallback: bool,
}

impl ChatTemplate {
    /// Compiles `source` (or ChatML when `None`). `bos` and `eos` are the texts of the
    /// model's special tokens, which templates may refer to.
    pub fn new(source: Option<&str>, bos: &str, eos: &str) -> Result<Self> {
        let is_fallback = source.is_none();
        let source = source.unwrap_or(CHATML).to_owned();
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    message,
                ))
            },
        );
        env.add_function("strftime_now", |_format: String| -> String {
            // Templates use it to print today's date; a fixed date keeps prompts (and
            // so results) reproducible.
            "26 Jul 2024".to_owned()
        });
        env.add_template_owned("chat", source.clone())
            .map_err(|e| ModelError::Template(with_causes(&e)))?;
        Ok(Self {
            env,
            source,
            bos: bos.to_owned(),
            eos: eos.to_owned(),
            is_fallback,
        })
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether this is the ChatML fallback rather than the model's own template.
    pub fn is_fallback(&self) -> bool {
        self.is_fallback
    }

    /// Whether the template itself knows about tools (otherwise tools are described in
    /// a system block by the caller).
    pub fn handles_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Renders a conversation. `tools` are OpenAI tool definitions
    /// (`{"type": "function", "function": {...}}`).
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(ModelError::InvalidRequest(
                "messages must not be empty".into(),
            ));
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(with_causes(&e)))?;
        // Templates expect arguments as objects; the API carries them as JSON text.
        let messages: Vec<Json> = messages
            .iter()
            .map(|m| {
                let mut value = serde_json::to_value(m).unwrap_or(Json::Null);
                if let Some(calls) = value.get_mut("tool_calls").and_then(Json::as_array_mut) {
                    for call in calls {
                        if let Some(args) = call.pointer_mut("/function/arguments")
                            && let Some(text) = args.as_str()
                            && let Ok(parsed) = serde_json::from_str::<Json>(text)
                        {
                            *args = parsed;
                        }
                    }
                }
                value
            })
            .collect();
        let tools: Option<Vec<Json>> = tools.map(|t| t.to_vec());
        template
            .render(minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos,
                eos_token => self.eos,
            })
            .map_err(|e| ModelError::Template(with_causes(&e)))
    }
}

/// For templates that know nothing of tools (SmolLM2's): describe the tools in the
/// system prompt and write calls and results in the Hermes convention the model was
/// tuned on, as plain text the template can render.
pub(crate) fn lower_tools(messages: Vec<Message>, tools: &[Json]) -> Vec<Message> {
    let mut description = String::from(
        "You may call one or more functions to assist with the user query. You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
    );
    for tool in tools {
        description.push_str(&tool.to_string());
        description.push('\n');
    }
    description.push_str("</tools>\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    let mut out = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages.into_iter().peekable();
    if tools.is_empty() {
        // Only the lowering of calls and results below.
    } else if rest.peek().is_some_and(|m| m.role == "system") {
        let mut system = rest.next().expect("peeked");
        let text = system.content.take().unwrap_or_default();
        system.content = Some(format!("{text}\n\n{description}").trim_start().to_owned());
        out.push(system);
    } else {
        out.push(Message::new("system", description));
    }
    for mut m in rest {
        if let Some(calls) = m.tool_calls.take() {
            let mut text = m.content.take().unwrap_or_default();
            for call in calls {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&format!(
                    "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
                    Json::String(call.function.name),
                    call.function.arguments
                ));
            }
            m.content = Some(text);
        }
        if m.role == "tool" {
            m.role = "user".into();
            m.content = Some(format!(
                "<tool_response>\n{}\n</tool_response>",
                m.content.unwrap_or_default()
            ));
            m.tool_call_id = None;
        }
        if m.content.is_none() {
            m.content = Some(String::new());
        }
        out.push(m);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_a_generation_prompt() {
        let template = ChatTemplate::new(None, "", "<|im_end|>").unwrap();
        let text = template
            .render(
                &[
                    Message::new("system", "Be brief."),
                    Message::new("user", "Hi"),
                ],
                None,
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_describes_tools_and_renders_calls() {
        let template = ChatTemplate::new(None, "", "<|im_end|>").unwrap();
        let tool = serde_json::json!({"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}});
        let mut call = Message::new("assistant", "");
        call.content = None;
        call.tool_calls = Some(vec![ToolCall {
            id: "c1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "add".into(),
                arguments: r#"{"a": 1}"#.into(),
            },
        }]);
        let text = template
            .render(
                &[Message::new("user", "1+1?"), call, {
                    let mut m = Message::new("tool", "2");
                    m.tool_call_id = Some("c1".into());
                    m
                }],
                Some(&[tool]),
                true,
            )
            .unwrap();
        // Keys keep the order the caller gave them, as Python's `json.dumps` does in the
        // reference renderer (not sorted).
        assert!(
            text.contains("<tools>\n{\"type\":\"function\",\"function\":"),
            "{text}"
        );
        assert!(text.contains("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call><|im_end|>"), "{text}");
        assert!(
            text.contains("<tool_response>\n2\n</tool_response>"),
            "{text}"
        );
        assert!(text.ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn python_string_methods_work() {
        let template =
            ChatTemplate::new(Some("{{ messages[0].content.strip().upper() }}"), "", "").unwrap();
        let text = template
            .render(&[Message::new("user", "  hi  ")], None, false)
            .unwrap();
        assert_eq!(text, "HI");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let template =
            ChatTemplate::new(Some("{{ raise_exception('no system role') }}"), "", "").unwrap();
        let error = template
            .render(&[Message::new("user", "x")], None, false)
            .unwrap_err();
        assert!(error.to_string().contains("no system role"), "{error}");
    }
}
