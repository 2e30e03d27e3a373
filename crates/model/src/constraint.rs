//! Grammar-constrained decoding with llguidance: JSON schemas, Lark grammars, and tool
//! calls, so the model can only produce output the grammar accepts.
//!
//! A [`ConstraintCompiler`] is built once per tokenizer (it indexes every token's bytes
//! in a trie); each request compiles its grammar into a [`Constraint`], which gives the
//! set of allowed tokens at each step and follows the tokens chosen.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value as Json, json};

use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;

/// The opening and closing tags of a tool call (Hermes / Qwen / SmolLM convention).
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// See [`TOOL_CALL_OPEN`].
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        let mut ids = self.tokenizer.encode(&text, false).unwrap_or_default();
        if self
            .tokenizer
            .bos()
            .is_some_and(|b| ids.first() == Some(&b))
        {
            ids.remove(0);
        }
        ids
    }
}

/// Compiles grammars for one tokenizer.
#[derive(Clone)]
pub struct ConstraintCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for ConstraintCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintCompiler").finish_non_exhaustive()
    }
}

impl ConstraintCompiler {
    /// Indexes the tokenizer's vocabulary.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let words: Vec<Vec<u8>> = (0..tokenizer.vocab_size() as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                if tokenizer.is_special(id) {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend_from_slice(bytes);
                    marked
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let eos = tokenizer.end_tokens().first().copied().unwrap_or(0);
        let mut info = TokRxInfo::new(words.len() as u32, eos);
        info.tok_bos = tokenizer.bos();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ModelError::InvalidRequest(format!("grammar engine: {e}")))?;
        factory.set_stderr_log_level(0);
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    fn compile(&self, grammar: TopLevelGrammar, what: &str) -> Result<Constraint> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ModelError::InvalidRequest(format!("invalid {what}: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(ModelError::InvalidRequest(format!(
                "invalid {what}: {error}"
            )));
        }
        Ok(Constraint { matcher })
    }

    /// Output must be one JSON value valid under `schema` (compact separators).
    pub fn json_schema(&self, schema: &Json) -> Result<Constraint> {
        if !schema.is_object() && !schema.is_boolean() {
            return Err(ModelError::InvalidRequest(
                "json_schema.schema must be a JSON Schema object".into(),
            ));
        }
        self.compile(
            TopLevelGrammar::from_json_schema(with_compact_json(schema.clone())),
            "JSON schema",
        )
    }

    /// Output must be some JSON object (`response_format: {"type": "json_object"}`).
    pub fn json_object(&self) -> Result<Constraint> {
        self.json_schema(&json!({"type": "object"}))
    }

    /// Output must match a Lark grammar (llguidance dialect).
    pub fn lark(&self, grammar: &str) -> Result<Constraint> {
        self.compile(TopLevelGrammar::from_lark(grammar.to_owned()), "grammar")
    }

    /// Output is free text or tool calls `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`
    /// whose names and arguments match the tools' schemas. With `choice.required`, at
    /// least one call and no free text; without `choice.parallel`, at most one call.
    /// `tools` are OpenAI tool definitions.
    pub fn tool_calls(&self, tools: &[Json], choice: ToolChoice) -> Result<Constraint> {
        let call = tool_call_schema(tools)?;
        let call = serde_json::to_string(&with_compact_json(call)).unwrap_or_default();
        let calls = if choice.parallel {
            "call (\"\\n\" call)*"
        } else {
            "call"
        };
        let grammar = format!(
            "start: {}\ncalls: {calls}\ncall: \"{TOOL_CALL_OPEN}\\n\" %json {call} \"\\n{TOOL_CALL_CLOSE}\"\nTEXT: /[^<]([^<]|<[^t])*/\n",
            if choice.required {
                "calls"
            } else {
                "calls | TEXT"
            },
        );
        self.lark(&grammar)
    }
}

/// How tool calls are constrained: OpenAI's `tool_choice` (`required` or a named tool
/// makes a call mandatory) and `parallel_tool_calls` (more than one call per turn).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolChoice {
    /// At least one call and no free text.
    pub required: bool,
    /// Several calls in one turn; without it the turn ends after the first call.
    pub parallel: bool,
}

/// The JSON schema of one call: `{"name": <one of the tools>, "arguments": <its schema>}`.
pub fn tool_call_schema(tools: &[Json]) -> Result<Json> {
    if tools.is_empty() {
        return Err(ModelError::InvalidRequest(
            "tools must not be empty when tool calls are constrained".into(),
        ));
    }
    let mut variants = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function").ok_or_else(|| {
            ModelError::InvalidRequest(format!(
                "tools[{i}] has no `function`; expected {{\"type\": \"function\", \"function\": {{\"name\": …, \"parameters\": {{…}}}}}}"
            ))
        })?;
        let name = function.get("name").and_then(Json::as_str).ok_or_else(|| {
            ModelError::InvalidRequest(format!("tools[{i}].function.name must be a string"))
        })?;
        let parameters = function
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        if !parameters.is_object() {
            return Err(ModelError::InvalidRequest(format!(
                "tools[{i}].function.parameters must be a JSON Schema object"
            )));
        }
        variants.push(json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    Ok(if variants.len() == 1 {
        variants.remove(0)
    } else {
        json!({"anyOf": variants})
    })
}

/// Fixed separators, no free whitespace: a small model given a choice of whitespace can
/// loop on it forever.
fn with_compact_json(mut schema: Json) -> Json {
    if let Some(object) = schema.as_object_mut() {
        object.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true}),
        );
    }
    schema
}

/// The state of one grammar over one generation.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").finish_non_exhaustive()
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }
}

/// The tokens allowed at one step.
#[derive(Debug)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }
}

impl Constraint {
    /// The tokens allowed next (end tokens included when the grammar may stop here).
    pub fn mask(&mut self) -> Result<TokenMask> {
        self.matcher
            .compute_mask_or_eos()
            .map(TokenMask)
            .map_err(|e| ModelError::InvalidRequest(format!("grammar: {e}")))
    }

    /// Follows a chosen token.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ModelError::InvalidRequest(format!("grammar: {e}")))
    }

    /// Whether the grammar has finished (nothing more may follow).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Finds tool calls in generated text: each `<tool_call>{json}</tool_call>` block whose
/// JSON has a string `name` and an `arguments` value. Returns the calls (name,
/// arguments as JSON text) and the text outside them.
pub fn parse_tool_calls(text: &str) -> (Vec<(String, String)>, String) {
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut at = 0;
    while let Some(open) = text[at..].find(TOOL_CALL_OPEN) {
        let start = at + open;
        let body_start = start + TOOL_CALL_OPEN.len();
        let Some(close) = text[body_start..].find(TOOL_CALL_CLOSE) else {
            break;
        };
        let body = text[body_start..body_start + close].trim();
        let parsed = serde_json::from_str::<Json>(body).ok().and_then(|v| {
            let name = v.get("name")?.as_str()?.to_owned();
            let arguments = v.get("arguments").cloned().unwrap_or(json!({}));
            Some((name, arguments.to_string()))
        });
        match parsed {
            Some(call) => {
                rest.push_str(&text[at..start]);
                calls.push(call);
            }
            None => rest.push_str(&text[at..body_start + close + TOOL_CALL_CLOSE.len()]),
        }
        at = body_start + close + TOOL_CALL_CLOSE.len();
    }
    rest.push_str(&text[at..]);
    (calls, rest.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hermes_tool_calls() {
        let text =
            "Sure.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let (calls, rest) = parse_tool_calls(text);
        assert_eq!(calls, vec![("add".to_owned(), "{\"a\":1}".to_owned())]);
        assert_eq!(rest, "Sure.");
    }

    #[test]
    fn malformed_calls_stay_text() {
        let (calls, rest) = parse_tool_calls("<tool_call>{oops</tool_call>");
        assert!(calls.is_empty());
        assert_eq!(rest, "<tool_call>{oops</tool_call>");
    }

    #[test]
    fn tool_schema_errors_name_the_field() {
        let error = tool_call_schema(&[json!({"type": "function"})]).unwrap_err();
        assert!(error.to_string().contains("tools[0]"), "{error}");
        let error =
            tool_call_schema(&[json!({"function": {"name": "f", "parameters": 3}})]).unwrap_err();
        assert!(error.to_string().contains("parameters"), "{error}");
    }
}
