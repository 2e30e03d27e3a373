//! agentstack-model against llama.cpp on the real test model (SmolLM2-135M-Instruct,
//! Q4_1): the same token ids, the same greedy continuations, the same log-probabilities.
//!
//! Needs `scripts/install-llamacpp` and `scripts/fetch-model` (CI runs both; `scripts/test`
//! too). llama.cpp is driven through one `llama-server` on a free loopback port.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentstack_model::generate::{GenerateRequest, generate};
use agentstack_model::sampling::log_softmax;
use agentstack_model::{LanguageModel, Logits, Message, SeqInput, WeightForm};
use agentstack_test_support::peers::{llama_bin, test_model as model_path};
use agentstack_test_support::ports::free_port;
use serde_json::{Value, json};

/// How far our log-probabilities may be from llama.cpp's, relative to how far llama.cpp's
/// own two attention paths are from each other on the same tokens.
///
/// Exact agreement is not a meaningful target on this model: Q4_1 weights multiply
/// activations quantized to 8 bits per block, a step function, so a 1e-7 difference in
/// summation order flips some roundings, and the 135M model amplifies them. Measured
/// here on a 37-token chat prompt (top-5 tokens at every position): llama.cpp default
/// (flash attention, f16 KV cache) against llama.cpp `-fa off -ctk f32 -ctv f32` differ by
/// mean 0.137 / max 0.717 nats; we differ from the default by mean 0.130 / max 0.853;
/// our own f32-dequantized weights differ from our quantized ones by mean 0.111. So the
/// test asks that we be no farther from llama.cpp than llama.cpp is from itself, with
/// this factor of headroom.
/// How long llama-server may take to load the model and answer `/health`.
const SERVER_READY: Duration = Duration::from_secs(180);

const SPREAD_FACTOR: f32 = 1.25;
/// Looser factor for the single worst token (a max is noisier than a mean).
const MAX_SPREAD_FACTOR: f32 = 1.5;
/// Greedy continuations may part only where llama.cpp itself was nearly indifferent
/// between the two tokens (this close in log-probability): a near-tie that the rounding
/// noise above decides either way. For scale: llama.cpp's default and its `-fa off -ctk
/// f32 -ctv f32` path part on 6 of 7 of these chat prompts within 32 tokens, once at
/// token 0 (the test measures those partings too: where llama.cpp's default parts from
/// its own other path on a wider gap, that gap is the limit). Either engine's near-tie
/// counts: both approximate the same f32 model, and where ours is indifferent (a
/// rounding decides) llama.cpp's gap may be anything within [`OUR_GAP_LIMIT`], the
/// spread of the two engines' log-probabilities measured on the prompts.
const NEAR_TIE_NATS: f32 = 0.3;
/// And under both engines the two tokens must be no farther apart than llama.cpp's two
/// paths ever disagree on a token (0.72 nats measured, see [`SPREAD_FACTOR`]).
const OUR_GAP_LIMIT: f32 = 1.0;
/// Tokens of each greedy continuation compared.
const GREEDY_TOKENS: usize = 32;

struct LlamaServer {
    child: Child,
    url: String,
    http: reqwest::Client,
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl LlamaServer {
    async fn start() -> Self {
        Self::start_with(&[]).await
    }

    async fn start_with(extra: &[&str]) -> Self {
        let port = free_port();
        let child = Command::new(llama_bin("llama-server"))
            .arg("-m")
            .arg(model_path())
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "-t",
                "1",
                "-c",
                "2048",
                "-np",
                "1",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting llama-server");
        let server = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            // A fresh connection per request: llama-server (cpp-httplib) closes an idle
            // keep-alive connection after 5 s, and a pooled one reused after a longer
            // pause (a slow scalar-kernel run of ours between two requests) failed the
            // POST with `IncompleteMessage`.
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .expect("an HTTP client"),
        };
        // Loading is seconds on an idle machine; a busy 2-core CI machine running other
        // tests beside it can take much longer.
        let deadline = Instant::now() + SERVER_READY;
        loop {
            if let Ok(r) = server
                .http
                .get(format!("{}/health", server.url))
                .send()
                .await
                && r.status().is_success()
            {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "llama-server did not become healthy in {SERVER_READY:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let response = self
            .http
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(
            response.status().is_success(),
            "{path}: {}",
            response.status()
        );
        response.json().await.unwrap()
    }

    async fn tokenize(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let v = self
            .post(
                "/tokenize",
                json!({"content": text, "add_special": false, "parse_special": parse_special}),
            )
            .await;
        serde_json::from_value(v["tokens"].clone()).unwrap()
    }

    /// Greedy tokens with llama.cpp's top alternatives at each position.
    async fn greedy(&self, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Value>) {
        let v = self
            .post(
                "/completion",
                json!({"prompt": prompt, "n_predict": n, "temperature": 0.0, "return_tokens": true, "n_probs": 5, "cache_prompt": false}),
            )
            .await;
        (
            serde_json::from_value(v["tokens"].clone()).unwrap(),
            v["completion_probabilities"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
        )
    }

    /// llama.cpp's log-probabilities of the next token after `prefix` (top 20).
    async fn next_logprobs(&self, prefix: &[u32]) -> Vec<(u32, f32)> {
        let v = self
            .post(
                "/completion",
                json!({"prompt": prefix, "n_predict": 1, "temperature": 0.0, "n_probs": 20, "cache_prompt": true}),
            )
            .await;
        v["completion_probabilities"][0]["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["id"].as_u64().unwrap() as u32,
                    t["logprob"].as_f64().unwrap() as f32,
                )
            })
            .collect()
    }
}

fn load() -> LanguageModel {
    LanguageModel::load(model_path(), WeightForm::Quantized).expect("loading the test model")
}

fn corpus() -> Vec<String> {
    serde_json::from_str(include_str!("../data/tokenizer_corpus.json")).unwrap()
}

fn chat(lm: &LanguageModel, user: &str) -> Vec<u32> {
    let text = lm
        .template()
        .render(&[Message::new("user", user)], None, true)
        .unwrap();
    lm.tokenizer().encode(&text, true).unwrap()
}

#[tokio::test]
#[ignore = "needs llama.cpp (scripts/install-llamacpp) and the SmolLM2 model (scripts/fetch-model)"]
async fn token_ids_match_llama_cpp_on_the_corpus() {
    let lm = load();
    let server = LlamaServer::start().await;
    let corpus = corpus();
    assert!(
        corpus.len() >= 200,
        "the corpus has {} strings",
        corpus.len()
    );
    let mut mismatches = Vec::new();
    for text in &corpus {
        for parse_special in [true, false] {
            let ours = lm.tokenizer().encode(text, parse_special).unwrap();
            let theirs = server.tokenize(text, parse_special).await;
            if ours != theirs {
                mismatches.push(format!(
                    "{text:?} (parse_special {parse_special}): ours {ours:?}, llama.cpp {theirs:?}"
                ));
            }
            // Decoding gives the text back.
            assert_eq!(lm.tokenizer().decode(&ours, false), *text);
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} differ:\n{}",
        mismatches.len(),
        corpus.len() * 2,
        mismatches.join("\n")
    );
}

fn prompts(lm: &LanguageModel) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain recursion to a child.",
        "List three prime numbers.",
        "How do I reverse a list in Python?",
        "Translate 'good morning' into Spanish.",
        "What is 12 times 12?",
        "Give me a tip for better sleep.",
    ]
    .iter()
    .map(|p| chat(lm, p))
    .collect();
    for raw in [
        "The history of the printing press",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
    ] {
        out.push(lm.tokenizer().encode(raw, false).unwrap());
    }
    out
}

/// The gap in log-probability between tokens `a` and `b` in one of llama.cpp's
/// completion steps (its top 5), or infinity when either is not among them.
fn top_gap(step: &Value, a: u32, b: u32) -> f32 {
    let alternatives = step["top_logprobs"].as_array().cloned().unwrap_or_default();
    let lp = |id: u32| {
        alternatives
            .iter()
            .find(|t| t["id"].as_u64() == Some(u64::from(id)))
            .and_then(|t| t["logprob"].as_f64())
            .map(|v| v as f32)
    };
    match (lp(a), lp(b)) {
        (Some(a), Some(b)) => (a - b).abs(),
        _ => f32::INFINITY,
    }
}

/// Our log-softmax at the position after `prefix`.
fn our_logprobs(lm: &LanguageModel, prefix: &[u32]) -> Vec<f32> {
    let mut cache = lm.model().new_cache();
    let logits = lm
        .model()
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: prefix,
            logits: Logits::Last,
        }])
        .unwrap();
    log_softmax(&logits[0].squeeze(0).unwrap().to_vec1::<f32>().unwrap())
}

#[tokio::test]
#[ignore = "needs llama.cpp (scripts/install-llamacpp) and the SmolLM2 model (scripts/fetch-model)"]
async fn greedy_continuations_match_llama_cpp() {
    let lm = load();
    let server = LlamaServer::start().await;
    let other_path = LlamaServer::start_with(&["-fa", "off", "-ctk", "f32", "-ctv", "f32"]).await;
    let prompts = prompts(&lm);
    assert!(prompts.len() >= 10);
    // How far apart two tokens were, under llama.cpp's default, where its default and
    // its other path part.
    let mut self_gaps = Vec::new();
    for prompt in &prompts {
        let (theirs, probs) = server.greedy(prompt, GREEDY_TOKENS).await;
        let (other, _) = other_path.greedy(prompt, GREEDY_TOKENS).await;
        if let Some(i) = theirs.iter().zip(&other).position(|(a, b)| a != b) {
            self_gaps.push(top_gap(&probs[i], theirs[i], other[i]));
        }
    }
    let self_max = self_gaps.iter().copied().fold(0f32, f32::max);
    let near_tie = NEAR_TIE_NATS.max(self_max);
    eprintln!(
        "llama.cpp's default and -fa off f32-cache paths part on {} of {} prompts, at gaps {self_gaps:.3?} nats under the default: near-tie limit {near_tie:.3}",
        self_gaps.len(),
        prompts.len()
    );
    let mut identical = 0;
    for prompt in &prompts {
        // Both stop at the model's end token (llama.cpp's ignore_eos bans the token
        // rather than ignoring it, so it cannot be compared).
        let ours = generate(&lm, &GenerateRequest::greedy(prompt.clone(), GREEDY_TOKENS))
            .unwrap()
            .tokens;
        let (theirs, probs) = server.greedy(prompt, GREEDY_TOKENS).await;
        let parted = ours
            .iter()
            .zip(&theirs)
            .position(|(a, b)| a != b)
            .or_else(|| {
                // One stopped (end token) where the other went on: that is a difference too,
                // at the shorter length (llama.cpp leaves its end token out).
                (ours.len() != theirs.len() && ours.len().min(theirs.len()) < GREEDY_TOKENS)
                    .then(|| ours.len().min(theirs.len()))
                    .filter(|&i| i < ours.len() && i < theirs.len())
            });
        match parted {
            None => identical += 1,
            Some(i) => {
                let mut prefix = prompt.clone();
                prefix.extend_from_slice(&ours[..i]);
                let lp = our_logprobs(&lm, &prefix);
                let gap = (lp[ours[i] as usize] - lp[theirs[i] as usize]).abs();
                // llama.cpp's own view of the same two tokens (from its top 5).
                let their_gap = top_gap(&probs[i], ours[i], theirs[i]);
                eprintln!(
                    "prompt {:?}: parts at token {i} (ours {} vs llama.cpp {}), gap {gap:.4} nats under ours, {their_gap:.4} under llama.cpp",
                    lm.tokenizer().decode(prompt, false),
                    ours[i],
                    theirs[i]
                );
                assert!(
                    their_gap.min(gap) <= near_tie && their_gap.max(gap) <= OUR_GAP_LIMIT,
                    "greedy tokens part at {i} on a gap of {their_gap} nats under llama.cpp and {gap} under ours: neither is a near-tie (at most {near_tie}), or one is over {OUR_GAP_LIMIT}: ours {:?}, llama.cpp {:?}",
                    lm.tokenizer().decode(&ours, false),
                    lm.tokenizer().decode(&theirs, false)
                );
            }
        }
    }
    eprintln!(
        "{identical} of {} greedy continuations identical for {GREEDY_TOKENS} tokens",
        prompts.len()
    );
}

#[tokio::test]
#[ignore = "needs llama.cpp (scripts/install-llamacpp) and the SmolLM2 model (scripts/fetch-model)"]
async fn prompt_logprobs_match_llama_cpp() {
    let lm = load();
    let reference = LlamaServer::start().await;
    let other_path = LlamaServer::start_with(&["-fa", "off", "-ctk", "f32", "-ctv", "f32"]).await;
    let texts = [
        chat(&lm, "Summarize the plot of Romeo and Juliet in two sentences."),
        lm.tokenizer()
            .encode("The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed the ocean blue; 3.14159 is pi.", false)
            .unwrap(),
        lm.tokenizer().encode("fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{:?}\", x);\n}\n", false).unwrap(),
    ];
    let (mut ours_sum, mut self_sum, mut ours_max, mut self_max, mut compared) =
        (0f32, 0f32, 0f32, 0f32, 0usize);
    for tokens in &texts {
        let scored = lm.score(tokens).unwrap();
        for i in 1..tokens.len() {
            let theirs = reference.next_logprobs(&tokens[..i]).await;
            let alternative: std::collections::HashMap<u32, f32> = other_path
                .next_logprobs(&tokens[..i])
                .await
                .into_iter()
                .collect();
            let mine = our_logprobs(&lm, &tokens[..i]);
            // The five most likely tokens at every position, not just the actual next one.
            for &(id, lp) in theirs.iter().take(5) {
                let Some(&other) = alternative.get(&id) else {
                    continue;
                };
                let d_ours = (mine[id as usize] - lp).abs();
                let d_self = (other - lp).abs();
                ours_sum += d_ours;
                self_sum += d_self;
                ours_max = ours_max.max(d_ours);
                self_max = self_max.max(d_self);
                compared += 1;
            }
            // One pass over the whole sequence scores like the incremental forward pass.
            assert!(
                (scored[i - 1] - mine[tokens[i] as usize]).abs() < 1e-3,
                "position {i}"
            );
        }
    }
    let (ours_mean, self_mean) = (ours_sum / compared as f32, self_sum / compared as f32);
    eprintln!(
        "{compared} log-probabilities: ours vs llama.cpp mean {ours_mean:.4} max {ours_max:.4}; \
         llama.cpp vs itself (-fa off, f32 cache) mean {self_mean:.4} max {self_max:.4}"
    );
    assert!(compared > 500, "only {compared} log-probabilities compared");
    assert!(
        ours_mean <= SPREAD_FACTOR * self_mean,
        "mean |Δ| {ours_mean} > {SPREAD_FACTOR} × {self_mean}"
    );
    assert!(
        ours_max <= MAX_SPREAD_FACTOR * self_max,
        "max |Δ| {ours_max} > {MAX_SPREAD_FACTOR} × {self_max}"
    );
}
