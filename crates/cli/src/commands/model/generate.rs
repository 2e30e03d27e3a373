//! `agentstack model generate`: chat or completion from the terminal, streaming.

use std::io::Write;

use agentstack_model::generate::{GenerateRequest, Sequence};
use agentstack_model::{Logits, Message, SamplingParams};
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
    let as_tokens = args.tokens;
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut seq = Sequence::new(&lm, request)?;
        let mut stdout = std::io::stdout().lock();
        while !seq.is_finished() {
            let (input, n) = seq.input(usize::MAX);
            let mut batch = [input];
            let logits = lm.model().forward(&mut batch)?;
            if !seq.consumed(n) {
                continue;
            }
            let row: Vec<f32> = logits[0].squeeze(0)?.to_vec1()?;
            debug_assert!(matches!(Logits::Last, Logits::Last));
            let event = seq.sample(&lm, &row)?;
            if as_tokens {
                writeln!(
                    stdout,
                    "{}",
                    serde_json::json!({"id": event.token.id, "logprob": event.token.logprob, "text": event.text, "finish_reason": event.finish})
                )?;
            } else {
                stdout.write_all(event.text.as_bytes())?;
            }
            stdout.flush()?;
        }
        if !as_tokens {
            writeln!(stdout)?;
        }
        let out = seq.output();
        tracing::info!(tokens = out.tokens.len(), finish = ?out.finish, "done");
        Ok(())
    })
    .await
    .context("generation thread")??;
    Ok(())
}
