//! Malformed-tool-call rate, with and without grammar-constrained decoding.
//!
//! Every prompt of a fixed set asks for something one of four tools does. Each is sent
//! to the OpenAI-compatible server (in process, the same code `agentstack model serve`
//! runs) with the tools, greedy decoding, three ways:
//!
//! - `free`: the server without constraints: the model writes whatever it writes and the
//!   server parses `<tool_call>` blocks out of it;
//! - `auto`: constrained, `tool_choice: "auto"`: free text or well-formed calls;
//! - `required`: constrained, `tool_choice: "required"`.
//!
//! An answer counts as a valid call when it has a tool call whose name is one of the
//! tools and whose arguments satisfy the tool's schema (required keys, types, enums,
//! ranges); as malformed when it tried (a `<tool_call>` tag, or returned calls) and
//! failed; as text when it did not try.
//!
//! ```text
//! cargo run --release -p agentstack-bench-tool-calls -- --model SmolLM2-135M-Instruct.Q4_1.gguf
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use agentstack_model::constraint::ConstraintCompiler;
use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::server::{AppState, ServerConfig, app};
use agentstack_model::{LanguageModel, WeightForm};
use anyhow::{Context, bail};
use axum::body::Body;
use axum::http::Request;
use clap::Parser;
use serde_json::{Value, json};
use tower::ServiceExt;

#[derive(Parser)]
struct Args {
    /// The GGUF model.
    #[arg(long)]
    model: PathBuf,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 120)]
    max_tokens: usize,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}}),
        json!({"type": "function", "function": {"name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"], "additionalProperties": false}}}),
        json!({"type": "function", "function": {"name": "search", "description": "Search the web",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["query", "max_results"], "additionalProperties": false}}}),
        json!({"type": "function", "function": {"name": "send_email", "description": "Send an email",
            "parameters": {"type": "object", "properties": {
                "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
                "required": ["to", "subject", "body"], "additionalProperties": false}}}),
    ]
}

const PROMPTS: [&str; 40] = [
    "What's the weather in Paris?",
    "Is it cold in Oslo right now? Use fahrenheit.",
    "Tell me the temperature in Tokyo in celsius.",
    "How warm is it in Cairo?",
    "Weather report for New York please.",
    "Do I need an umbrella in London today?",
    "Check the weather in Sydney.",
    "What is the weather like in Berlin, in celsius?",
    "Current conditions in Toronto?",
    "Is it sunny in Madrid?",
    "What is 3 plus 4?",
    "Add 17 and 25.",
    "Compute 1000 + 2345.",
    "What's the sum of 8 and 13?",
    "Please add -5 and 12.",
    "How much is 99 plus 1?",
    "I need 250 added to 750.",
    "Sum these two numbers: 6 and 7.",
    "What do you get if you add 42 and 58?",
    "Add twelve and thirty.",
    "Search the web for the tallest building in the world.",
    "Find me 3 articles about Rust programming.",
    "Look up recipes for banana bread.",
    "Search for the latest news on electric cars, 5 results.",
    "Who won the 2018 World Cup? Search for it.",
    "Find information about the Eiffel Tower.",
    "Search for hiking trails near Denver, top 2.",
    "Look up the population of Canada.",
    "Search: best books of 2023.",
    "Find the definition of photosynthesis online.",
    "Email alice@example.com that the meeting moved to 3pm.",
    "Send an email to bob@example.com with subject Hello saying hi.",
    "Write to carol@example.com: the report is ready.",
    "Email my boss at boss@example.com that I am sick today.",
    "Send dave@example.com an email about the party on Friday.",
    "Let eve@example.com know by email that the package arrived.",
    "Email frank@example.com the subject 'Invoice' and tell him it is attached.",
    "Send a thank-you email to grace@example.com.",
    "Email heidi@example.com asking for the slides.",
    "Notify ivan@example.com by email that the server is down.",
];

/// Checks `value` against the subset of JSON Schema the tools use.
fn valid(schema: &Value, value: &Value) -> bool {
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        return options.contains(value);
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let Some(object) = value.as_object() else {
                return false;
            };
            let properties = schema.get("properties").and_then(Value::as_object);
            let required = schema
                .get("required")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if required
                .iter()
                .any(|k| k.as_str().is_none_or(|k| !object.contains_key(k)))
            {
                return false;
            }
            object
                .iter()
                .all(|(k, v)| match properties.and_then(|p| p.get(k)) {
                    Some(s) => valid(s, v),
                    None => schema.get("additionalProperties") != Some(&Value::Bool(false)),
                })
        }
        Some("string") => value.is_string(),
        Some("integer") => value.as_i64().is_some_and(|n| {
            schema
                .get("minimum")
                .and_then(Value::as_i64)
                .is_none_or(|m| n >= m)
                && schema
                    .get("maximum")
                    .and_then(Value::as_i64)
                    .is_none_or(|m| n <= m)
        }),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    }
}

#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    valid: usize,
    malformed: usize,
    /// Calls cut off by `max_tokens` (finish reason `length`) before they closed.
    truncated: usize,
    text: usize,
}

/// `valid`, `malformed`, `truncated` (an attempt cut off by `max_tokens`), or `text`.
fn classify(answer: &Value, tools: &[Value]) -> (&'static str, String) {
    let (kind, shown) = classify_text(answer, tools);
    let cut = answer["choices"][0]["finish_reason"] == "length";
    (
        if kind == "malformed" && cut {
            "truncated"
        } else {
            kind
        },
        shown,
    )
}

fn classify_text(answer: &Value, tools: &[Value]) -> (&'static str, String) {
    let message = &answer["choices"][0]["message"];
    let content = message["content"].as_str().unwrap_or("");
    if let Some(calls) = message["tool_calls"].as_array().filter(|c| !c.is_empty()) {
        let ok = calls.iter().all(|call| {
            let name = call["function"]["name"].as_str().unwrap_or("");
            let Some(tool) = tools.iter().find(|t| t["function"]["name"] == name) else {
                return false;
            };
            serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap_or(""))
                .is_ok_and(|args| valid(&tool["function"]["parameters"], &args))
        });
        let shown = calls
            .iter()
            .map(|c| format!("{}({})", c["function"]["name"], c["function"]["arguments"]))
            .collect::<Vec<_>>()
            .join(" ");
        return (if ok { "valid" } else { "malformed" }, shown);
    }
    let tried = content.contains("<tool_call") || content.trim_start().starts_with('{');
    (
        if tried { "malformed" } else { "text" },
        content.chars().take(100).collect(),
    )
}

async fn ask(
    state: &AppState,
    prompt: &str,
    tools: &[Value],
    choice: Option<&str>,
    max_tokens: usize,
) -> anyhow::Result<Value> {
    let mut body = json!({
        "messages": [{"role": "user", "content": prompt}],
        "tools": tools, "max_tokens": max_tokens, "temperature": 0,
    });
    if let Some(choice) = choice {
        body["tool_choice"] = json!(choice);
    }
    let request = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))?;
    let response = app(state.clone()).oneshot(request).await?;
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 24).await?;
    let value: Value = serde_json::from_slice(&bytes)?;
    if !status.is_success() {
        bail!("{status}: {value}");
    }
    Ok(value)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let lm = Arc::new(
        LanguageModel::load(&args.model, WeightForm::Quantized).context("loading the model")?,
    );
    let compiler = ConstraintCompiler::new(lm.tokenizer())?;
    let engine = Engine::start(lm.clone(), EngineConfig::default());
    let free = AppState::new(engine.clone(), None, ServerConfig::default());
    let constrained = AppState::new(engine, Some(compiler), ServerConfig::default());
    let tools = tools();
    let modes: [(&str, &AppState, Option<&str>); 3] = [
        ("free", &free, None),
        ("auto", &constrained, Some("auto")),
        ("required", &constrained, Some("required")),
    ];
    let bar = indicatif::ProgressBar::new((PROMPTS.len() * modes.len()) as u64);
    let mut results = serde_json::Map::new();
    let mut lines = Vec::new();
    for (mode, state, choice) in modes {
        let mut tally = Tally::default();
        let mut samples = Vec::new();
        for prompt in PROMPTS {
            let answer = ask(state, prompt, &tools, choice, args.max_tokens).await?;
            let (kind, shown) = classify(&answer, &tools);
            match kind {
                "valid" => tally.valid += 1,
                "malformed" => tally.malformed += 1,
                "truncated" => tally.truncated += 1,
                _ => tally.text += 1,
            }
            samples.push(json!({"prompt": prompt, "kind": kind, "answer": shown}));
            bar.inc(1);
        }
        let n = PROMPTS.len() as f64;
        let tried = (tally.valid + tally.malformed + tally.truncated).max(1) as f64;
        lines.push(format!(
            "{mode:<9} valid {:>2}/{}  malformed {:>2} ({:>5.1}% of all, {:>5.1}% of attempts)  cut off by max_tokens {:>2} ({:>5.1}% of attempts)  plain text {:>2}",
            tally.valid,
            PROMPTS.len(),
            tally.malformed,
            100.0 * tally.malformed as f64 / n,
            100.0 * tally.malformed as f64 / tried,
            tally.truncated,
            100.0 * tally.truncated as f64 / tried,
            tally.text
        ));
        results.insert(
            mode.to_owned(),
            json!({"valid": tally.valid, "malformed": tally.malformed, "truncated": tally.truncated, "text": tally.text, "prompts": PROMPTS.len(), "samples": samples}),
        );
    }
    bar.finish_and_clear();
    println!(
        "model {} · {} prompts · greedy · max_tokens {}",
        lm.info().name,
        PROMPTS.len(),
        args.max_tokens
    );
    for line in lines {
        println!("{line}");
    }
    if let Some(path) = args.json {
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&Value::Object(results))?,
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
