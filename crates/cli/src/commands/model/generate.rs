//! `agentstack model generate`: chat or completion from the terminal, streaming.

use std::io::Write;
use std::sync::Arc;

use agentstack_model::engine::{Engine, EngineConfig, Event};
use agentstack_model::generate::GenerateRequest;
use agentstack_model::speculate::Speculation;
use agentstack_model::{Message, SamplingParams};
use anyhow::Context;

use crate::Exit;
use crate::args::GenerateArgs;

/// Runs the command.
pub async fn run(args: GenerateArgs) -> Result<(), Exit> {
    let lm = super::load(&args.run.model, args.run.threads).await?;
    let prompt = if args.raw {
        lm.tokenizer()
            .encode(&args.prompt, false)
            .map_err(anyhow::Error::from)?
    } else {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(Message::new("system", system.clone()));
        }
        messages.push(Message::new("user", args.prompt.clone()));
        let text = lm
            .template()
            .render(&messages, None, true)
            .map_err(anyhow::Error::from)?;
        lm.tokenizer()
            .encode(&text, true)
            .map_err(anyhow::Error::from)?
    };
    let request = GenerateRequest {
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
            ..SamplingParams::default()
        },
        stop: args.stop.clone(),
        detect_loops: true,
        ..GenerateRequest::greedy(prompt, args.max_tokens)
    };
    // The serving engine, one sequence: prompt-lookup speculation as `model serve` has
    // it (the same tokens with it or without).
    let engine = Engine::start(
        Arc::new(lm),
        EngineConfig {
            max_running: 1,
            max_waiting: 1,
            prefix_cache_bytes: 0,
            speculation: Speculation {
                max_draft: args.speculative_draft,
                ..Speculation::default()
            },
            ..EngineConfig::default()
        },
    );
    let mut events = engine.submit(request).map_err(anyhow::Error::from)?;
    let mut stdout = std::io::stdout().lock();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token(event) if args.tokens => writeln!(
                stdout,
                "{}",
                serde_json::json!({"id": event.token.id, "logprob": event.token.logprob, "text": event.text, "finish_reason": event.finish})
            )
            .context("writing to stdout")?,
            Event::Token(event) => stdout
                .write_all(event.text.as_bytes())
                .context("writing to stdout")?,
            Event::Done(out) => {
                if !args.tokens {
                    writeln!(stdout).context("writing to stdout")?;
                }
                tracing::info!(
                    tokens = out.tokens.len(),
                    drafted = out.draft_tokens,
                    finish = ?out.finish,
                    "done"
                );
                return Ok(());
            }
            Event::Error(e) => return Err(anyhow::Error::from(e).into()),
        }
        stdout.flush().context("writing to stdout")?;
    }
    Err(anyhow::anyhow!("the generation stopped before its end").into())
}
