//! Quick prefill/decode timing of one model, for kernel work:
//! `cargo run --release -p agentstack-model --example speed -- MODEL [PROMPT_TOKENS] [DECODE_TOKENS]`.
//! (The side-by-side benchmark against llama.cpp is `bench/inference`.)

use std::time::Instant;

use agentstack_model::{LanguageModel, Logits, SeqInput, WeightForm};

/// The `agentstack` binary's allocator, so that prefill times are the binary's: with
/// glibc's, each forward pass's large buffers were faulted in afresh (1B IQ4_XS prefill,
/// one thread, 132 tok/s against 151).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: speed MODEL [PROMPT_TOKENS] [DECODE_TOKENS]")?;
    let prompt: usize = args.next().map_or(Ok(64), |a| a.parse())?;
    let decode: usize = args.next().map_or(Ok(64), |a| a.parse())?;
    let lm = LanguageModel::load(&path, WeightForm::Quantized)?;
    let model = lm.model();
    let tokens: Vec<u32> = (0..prompt as u32).map(|i| 100 + i * 7 % 1000).collect();
    for round in 0..3 {
        let mut cache = model.new_cache();
        let start = Instant::now();
        model.forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &tokens,
            logits: Logits::Last,
        }])?;
        let prefill = start.elapsed().as_secs_f64();
        let start = Instant::now();
        for i in 0..decode {
            let t = [200 + i as u32];
            model.forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: &t,
                logits: Logits::Last,
            }])?;
        }
        let decoding = start.elapsed().as_secs_f64();
        println!(
            "round {round}: prefill {prompt} tokens {:.1} tok/s, decode {decode} tokens {:.1} tok/s",
            prompt as f64 / prefill,
            decode as f64 / decoding
        );
    }
    Ok(())
}
