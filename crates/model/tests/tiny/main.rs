//! A tiny random model the tests write themselves, as a Hugging Face checkpoint and as
//! the equivalent GGUF file (q and k permuted the way llama.cpp's converter does), so the
//! two loaders, the two rotary layouts, the two weight forms, batching and the server
//! are checked in milliseconds without the real model.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use agentstack_model::engine::{Engine, EngineConfig};
use agentstack_model::generate::{GenerateRequest, generate, generate_batch};
use agentstack_model::server::{ApiKey, AppState, ServerConfig, app};
use agentstack_model::{LanguageModel, Logits, SamplingParams, SeqInput, WeightForm};
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor};
use serde_json::{Value, json};
use tower::ServiceExt;

const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 96;
const CONTEXT: usize = 256;
/// The two loaders compute the same function in f32; they differ by rounding only.
const SAME_MODEL_TOLERANCE: f32 = 1e-4;
const TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// GPT-2's byte-level alphabet, in byte order.
fn byte_chars() -> Vec<char> {
    let printable: Vec<u8> = (b'!'..=b'~')
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut next = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable.contains(&b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(255 + next).unwrap()
            }
        })
        .collect()
}

fn vocab() -> Vec<String> {
    let mut pieces: Vec<String> = byte_chars().into_iter().map(String::from).collect();
    pieces.push("Ġt".into());
    pieces.push("<|im_start|>".into());
    pieces.push("<|im_end|>".into());
    pieces
}

/// Deterministic pseudo-random values.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5) * 2.0 * scale
        })
        .collect()
}

fn tensor(seed: u64, shape: &[usize], scale: f32) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(values(seed, n, scale), shape, &Device::Cpu).unwrap()
}

fn hf_weights() -> Vec<(String, Tensor)> {
    let vocab = vocab().len();
    let (q_dim, kv_dim) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut out = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            tensor(1, &[vocab, HIDDEN], 0.5),
        ),
        (
            "model.norm.weight".to_owned(),
            (tensor(2, &[HIDDEN], 0.1) + 1.0).unwrap(),
        ),
    ];
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        let s = 100 * (i as u64 + 1);
        out.push((
            format!("{p}.input_layernorm.weight"),
            (tensor(s, &[HIDDEN], 0.1) + 1.0).unwrap(),
        ));
        out.push((
            format!("{p}.post_attention_layernorm.weight"),
            (tensor(s + 1, &[HIDDEN], 0.1) + 1.0).unwrap(),
        ));
        out.push((
            format!("{p}.self_attn.q_proj.weight"),
            tensor(s + 2, &[q_dim, HIDDEN], 0.3),
        ));
        out.push((
            format!("{p}.self_attn.k_proj.weight"),
            tensor(s + 3, &[kv_dim, HIDDEN], 0.3),
        ));
        out.push((
            format!("{p}.self_attn.v_proj.weight"),
            tensor(s + 4, &[kv_dim, HIDDEN], 0.3),
        ));
        out.push((
            format!("{p}.self_attn.o_proj.weight"),
            tensor(s + 5, &[HIDDEN, q_dim], 0.3),
        ));
        out.push((
            format!("{p}.mlp.gate_proj.weight"),
            tensor(s + 6, &[FFN, HIDDEN], 0.3),
        ));
        out.push((
            format!("{p}.mlp.up_proj.weight"),
            tensor(s + 7, &[FFN, HIDDEN], 0.3),
        ));
        out.push((
            format!("{p}.mlp.down_proj.weight"),
            tensor(s + 8, &[HIDDEN, FFN], 0.3),
        ));
    }
    out
}

fn write_hf(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let pieces = vocab();
    let n = pieces.len();
    std::fs::write(
        dir.join("config.json"),
        json!({"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
               "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": FFN,
               "vocab_size": n, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "max_position_embeddings": CONTEXT, "tie_word_embeddings": true})
        .to_string(),
    )
    .unwrap();
    let vocab: serde_json::Map<String, Value> = pieces[..n - 2]
        .iter()
        .enumerate()
        .map(|(i, p)| (p.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = [(n - 2, "<|im_start|>"), (n - 1, "<|im_end|>")]
        .iter()
        .map(|(id, c)| json!({"id": id, "content": c, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    std::fs::write(
        dir.join("tokenizer.json"),
        json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
               "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
               "post_processor": null,
               "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
               "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                         "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                         "vocab": vocab, "merges": ["Ġ t"]}})
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE})
            .to_string(),
    )
    .unwrap();
    let weights: std::collections::HashMap<String, Tensor> = hf_weights().into_iter().collect();
    candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
}

/// llama.cpp's converter permutes q and k so that its interleaved rotary equals the
/// checkpoint's half-split one.
fn permute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((heads, 2, rows / heads / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

fn write_gguf(path: &Path) {
    write_gguf_as(path, GgmlDType::F32);
}

/// The GGUF file with its matrices in `dtype` (the norms stay f32).
fn write_gguf_as(path: &Path, dtype: GgmlDType) {
    let pieces = vocab();
    let n = pieces.len();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut add = |name: &str, t: &Tensor| {
        let dtype = if t.rank() == 2 { dtype } else { GgmlDType::F32 };
        tensors.push((name.to_owned(), QTensor::quantize(t, dtype).unwrap()))
    };
    for (name, t) in hf_weights() {
        let gguf = match name.as_str() {
            "model.embed_tokens.weight" => "token_embd.weight".to_owned(),
            "model.norm.weight" => "output_norm.weight".to_owned(),
            other => {
                let rest = other.strip_prefix("model.layers.").unwrap();
                let (i, part) = rest.split_once('.').unwrap();
                let part = match part {
                    "input_layernorm.weight" => "attn_norm.weight",
                    "post_attention_layernorm.weight" => "ffn_norm.weight",
                    "self_attn.q_proj.weight" => "attn_q.weight",
                    "self_attn.k_proj.weight" => "attn_k.weight",
                    "self_attn.v_proj.weight" => "attn_v.weight",
                    "self_attn.o_proj.weight" => "attn_output.weight",
                    "mlp.gate_proj.weight" => "ffn_gate.weight",
                    "mlp.up_proj.weight" => "ffn_up.weight",
                    "mlp.down_proj.weight" => "ffn_down.weight",
                    other => panic!("{other}"),
                };
                format!("blk.{i}.{part}")
            }
        };
        let t = if gguf.ends_with("attn_q.weight") {
            permute(&t, HEADS)
        } else if gguf.ends_with("attn_k.weight") {
            permute(&t, KV_HEADS)
        } else {
            t
        };
        add(&gguf, &t);
    }
    use gguf_file::Value as V;
    let strings = |v: Vec<String>| V::Array(v.into_iter().map(V::String).collect());
    let types: Vec<V> = (0..n)
        .map(|i| V::I32(if i >= n - 2 { 3 } else { 1 }))
        .collect();
    let metadata: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("llama".into())),
        ("general.name", V::String("tiny".into())),
        ("llama.embedding_length", V::U32(HIDDEN as u32)),
        ("llama.block_count", V::U32(LAYERS as u32)),
        ("llama.attention.head_count", V::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", V::U32(KV_HEADS as u32)),
        ("llama.feed_forward_length", V::U32(FFN as u32)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("llama.rope.freq_base", V::F32(10000.0)),
        ("llama.context_length", V::U32(CONTEXT as u32)),
        ("tokenizer.ggml.model", V::String("gpt2".into())),
        ("tokenizer.ggml.pre", V::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(pieces)),
        ("tokenizer.ggml.merges", strings(vec!["Ġ t".into()])),
        ("tokenizer.ggml.token_type", V::Array(types)),
        ("tokenizer.ggml.bos_token_id", V::U32(n as u32 - 2)),
        ("tokenizer.ggml.eos_token_id", V::U32(n as u32 - 1)),
        ("tokenizer.chat_template", V::String(TEMPLATE.into())),
    ];
    let metadata_refs: Vec<(&str, &V)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &metadata_refs, &tensor_refs).unwrap();
}

struct Fixture {
    _dir: tempfile::TempDir,
    hf: PathBuf,
    gguf: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    let gguf = dir.path().join("tiny.gguf");
    write_hf(&hf);
    write_gguf(&gguf);
    Fixture {
        _dir: dir,
        hf,
        gguf,
    }
}

/// The fixture's model as a Q8_0 GGUF file beside it: on this crate's kernels, so its
/// passes are exact in pieces (what speculative decoding needs).
fn q8_gguf(f: &Fixture) -> PathBuf {
    let q8 = f.gguf.with_file_name("tiny-q8_0.gguf");
    write_gguf_as(&q8, GgmlDType::Q8_0);
    q8
}

fn all_logits(lm: &LanguageModel, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = lm.model().new_cache();
    let out = lm
        .model()
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens,
            logits: Logits::All,
        }])
        .unwrap();
    out[0].to_vec2().unwrap()
}

#[test]
fn gguf_and_hugging_face_loaders_build_the_same_model() {
    let f = fixture();
    let dense = WeightForm::Dense(DType::F32);
    let from_hf = LanguageModel::load(&f.hf, dense).unwrap();
    let from_gguf = LanguageModel::load(&f.gguf, dense).unwrap();
    for text in ["hello there", "<|im_start|>user\nhi<|im_end|>", "tt t  t"] {
        assert_eq!(
            from_hf.tokenizer().encode(text, true).unwrap(),
            from_gguf.tokenizer().encode(text, true).unwrap(),
            "{text:?}"
        );
    }
    let tokens = from_gguf
        .tokenizer()
        .encode("the tiny model talks", false)
        .unwrap();
    let (a, b) = (
        all_logits(&from_hf, &tokens),
        all_logits(&from_gguf, &tokens),
    );
    for (ra, rb) in a.iter().zip(&b) {
        for (x, y) in ra.iter().zip(rb) {
            assert!((x - y).abs() < SAME_MODEL_TOLERANCE, "{x} vs {y}");
        }
    }
    // Same shape; the rotary layout differs (GGUF stores q/k permuted for it).
    let (g, h) = (&from_gguf.info().config, &from_hf.info().config);
    assert_eq!(
        (g.layers, g.heads, g.kv_heads, g.head_dim, g.ffn_size),
        (h.layers, h.heads, h.kv_heads, h.head_dim, h.ffn_size)
    );
    assert_ne!(g.rope_layout, h.rope_layout);
}

#[test]
fn quantized_form_tracks_dense_and_batches_exactly() {
    let f = fixture();
    let dense = LanguageModel::load(&f.gguf, WeightForm::Dense(DType::F32)).unwrap();
    // The F32 GGUF has no quantized kernel: candle's matmul serves it. The HF
    // checkpoint is quantized to Q8_0 at load and goes through this crate's kernels.
    let quantized = LanguageModel::load(&f.hf, WeightForm::Quantized).unwrap();
    let tokens = dense
        .tokenizer()
        .encode("quantized weights", false)
        .unwrap();
    let (a, b) = (all_logits(&dense, &tokens), all_logits(&quantized, &tokens));
    let mean: f32 = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .sum::<f32>()
        / a.iter().flatten().count() as f32;
    assert!(mean < 0.05, "mean |Δ logit| {mean}");

    let requests: Vec<GenerateRequest> = ["a", "bb bb", "c c c c c", "the"]
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest {
            sampling: SamplingParams {
                seed: Some(i as u64),
                ..Default::default()
            },
            top_logprobs: 2,
            ignore_eos: true,
            ..GenerateRequest::greedy(quantized.tokenizer().encode(p, false).unwrap(), 10 + i)
        })
        .collect();
    let together = generate_batch(&quantized, &requests).unwrap();
    for (r, t) in requests.iter().zip(&together) {
        assert_eq!(generate(&quantized, r).unwrap(), *t);
    }
}

#[tokio::test]
async fn the_server_answers_on_the_tiny_model() {
    let f = fixture();
    let lm = Arc::new(LanguageModel::load(&f.gguf, WeightForm::Quantized).unwrap());
    let state = AppState::new(
        Engine::start(lm, EngineConfig::default()),
        None,
        ServerConfig::default(),
    );
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 2, "ignore_eos": true});
    let request = axum::http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    let response = app(state).oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 5, "{answer}");
    assert_eq!(
        answer["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
}

/// Asserts that a call was refused with a 400 whose message holds each of `says`.
fn assert_refused((status, answer): &(u16, Value), says: &[&str]) {
    assert_eq!(*status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    for part in says {
        assert!(message.contains(part), "{part:?} not in {answer}");
    }
}

async fn call(state: &AppState, method: &str, uri: &str, body: Option<Value>) -> (u16, Value) {
    let request = axum::http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        ))
        .unwrap();
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Adapters with random (non-zero) `B`, so they change the model.
fn random_adapter(model: &agentstack_model::Model) -> agentstack_model::adapter::Adapter {
    use agentstack_model::adapter::{Adapter, AdapterWeights, Target};
    let mut weights = Vec::new();
    for (i, block) in model.blocks().iter().enumerate() {
        for (j, target) in [Target::Q, Target::V].into_iter().enumerate() {
            let (out, inp) = target.of(block).shape().unwrap();
            let seed = (i * 2 + j) as u64;
            weights.push(AdapterWeights {
                block: i,
                target,
                a: Tensor::from_vec(values(100 + seed, 4 * inp, 0.5), (4, inp), &Device::Cpu)
                    .unwrap(),
                b: Tensor::from_vec(values(200 + seed, out * 4, 0.5), (out, 4), &Device::Cpu)
                    .unwrap(),
            });
        }
    }
    Adapter {
        alpha: 8.0,
        rank: 4,
        weights,
    }
}

#[tokio::test]
async fn named_adapters_load_replace_and_serve() {
    let f = fixture();
    let lm = Arc::new(LanguageModel::load(&f.gguf, WeightForm::Quantized).unwrap());
    let adapter = random_adapter(lm.model());
    let path = f._dir.path().join("adapter.safetensors");
    adapter.save(&path).unwrap();
    let engine = Engine::start(lm.clone(), EngineConfig::default());
    let state = AppState::new(
        engine.clone(),
        None,
        ServerConfig {
            adapter_dir: Some(f._dir.path().to_path_buf()),
            ..ServerConfig::default()
        },
    );

    // Unknown adapters and bad files are refused with a reason.
    let gen_body = |model: &str| json!({"input_ids": [1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": true, "model": model});
    // A name that is neither the base model's nor a loaded adapter's is a 404 on every
    // route that takes one, never a silent run on the base weights.
    for (route, body) in [
        ("/generate", gen_body("nope")),
        (
            "/v1/chat/completions",
            json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ),
        (
            "/v1/completions",
            json!({"model": "nope", "prompt": "hi", "max_tokens": 2}),
        ),
    ] {
        let (status, err) = call(&state, "POST", route, Some(body)).await;
        assert_eq!(status, 404, "{route}: {err}");
        assert_eq!(err["error"]["code"], "model_not_found", "{route}: {err}");
        assert_eq!(err["error"]["param"], "model", "{route}: {err}");
        let message = err["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("`nope`") && message.contains("`model`"),
            "the message names what was asked and what is served: {message}"
        );
    }
    let long = "x".repeat(10_000);
    let (status, err) = call(&state, "POST", "/generate", Some(gen_body(&long))).await;
    assert_eq!(status, 404);
    assert!(
        err["error"]["message"].as_str().unwrap().len() < 400,
        "a long name is not echoed whole: {err}"
    );
    let refused = call(
        &state,
        "POST",
        "/v1/adapters",
        Some(json!({"name": "tuned", "path": f.gguf})),
    )
    .await;
    assert_refused(&refused, &["safetensors"]);
    let (status, err) = call(
        &state,
        "POST",
        "/v1/adapters",
        Some(json!({"name": "bad name!", "path": path})),
    )
    .await;
    assert_eq!(status, 400, "{err}");
    let (status, err) = call(&state, "DELETE", "/v1/adapters/tuned", None).await;
    assert_eq!(status, 404, "{err}");

    // Load, and the adapter's greedy tokens follow the adapted model, not the base.
    let (status, loaded) = call(
        &state,
        "POST",
        "/v1/adapters",
        Some(json!({"name": "tuned", "path": path})),
    )
    .await;
    assert_eq!(status, 200, "{loaded}");
    assert_eq!(loaded["version"], 1);
    let (_, models) = call(&state, "GET", "/v1/models", None).await;
    assert_eq!(models["data"][1]["id"], "tuned", "{models}");
    let (_, base_out) = call(&state, "POST", "/generate", Some(gen_body("model"))).await;
    let (_, tuned_out) = call(&state, "POST", "/generate", Some(gen_body("tuned"))).await;
    assert_ne!(base_out["output_ids"], tuned_out["output_ids"]);
    // Each token of a generation on the adapter says the version that sampled it, on
    // /generate and in a chat completion's token ids.
    assert!(base_out.get("weights_versions").is_none(), "{base_out}");
    let tokens = tuned_out["output_ids"].as_array().unwrap().len();
    assert_eq!(tuned_out["weights_versions"], json!(vec![1; tokens]));
    let chat = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": true});
    let (status, tuned_chat) =
        call(&state, "POST", "/v1/chat/completions", Some(chat("tuned"))).await;
    assert_eq!(status, 200, "{tuned_chat}");
    let tokens = tuned_chat["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(
        tuned_chat["choices"][0]["weights_versions"],
        json!(vec![1; tokens])
    );
    let (_, base_chat) = call(&state, "POST", "/v1/chat/completions", Some(chat("model"))).await;
    assert!(
        base_chat["choices"][0].get("weights_versions").is_none(),
        "{base_chat}"
    );
    let adapted = adapter.apply(lm.model()).unwrap();
    let mut cache = adapted.new_cache();
    let first = adapted
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &[1, 2, 3],
            logits: Logits::Last,
        }])
        .unwrap()[0]
        .flatten_all()
        .unwrap()
        .argmax(0)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap();
    assert_eq!(tuned_out["output_ids"][0], first);

    // The same request alone and among others (some on other weights) gives the same
    // tokens. (The tiny model's f32 weights go through candle's matmul, which may
    // round differently for another number of rows; Q4_1/Q8_0 models use this crate's
    // kernels and the adapters' row-by-row path, which do not.)
    let request = GenerateRequest {
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(5),
            ..SamplingParams::default()
        },
        ignore_eos: true,
        ..GenerateRequest::greedy(vec![1, 2, 3, 4], 8)
    };
    let alone = engine
        .generate_with(request.clone(), Some("tuned"))
        .await
        .unwrap();
    let mut others = Vec::new();
    for i in 0..5u32 {
        let mut r = request.clone();
        r.prompt = vec![1, 2 + i, 3, 4, 5, 6];
        others.push(
            engine
                .submit_with(r, if i % 2 == 0 { Some("tuned") } else { None })
                .unwrap(),
        );
    }
    let crowded = engine
        .generate_with(request.clone(), Some("tuned"))
        .await
        .unwrap();
    drop(others);
    assert_eq!(alone.tokens, crowded.tokens);
    for (a, b) in alone.logprobs.iter().zip(&crowded.logprobs) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }

    // Replacing the weights bumps the version and changes the answers; unloading
    // makes the name unknown to in-process callers.
    let mut zeroed = adapter.clone();
    for w in &mut zeroed.weights {
        w.b = w.b.zeros_like().unwrap();
    }
    assert_eq!(
        engine.set_adapter("tuned", zeroed.apply(lm.model()).unwrap()),
        2
    );
    let (_, replaced) = call(&state, "POST", "/generate", Some(gen_body("tuned"))).await;
    let tokens = replaced["output_ids"].as_array().unwrap().len();
    assert_eq!(replaced["weights_versions"], json!(vec![2; tokens]));
    assert_eq!(
        replaced["output_ids"], base_out["output_ids"],
        "B = 0 is the base"
    );
    let (status, _) = call(&state, "DELETE", "/v1/adapters/tuned", None).await;
    assert_eq!(status, 200);
    let (status, err) = call(&state, "POST", "/generate", Some(gen_body("tuned"))).await;
    assert_eq!(
        status, 404,
        "an unloaded adapter's name is unknown again: {err}"
    );
    assert!(matches!(
        engine.submit_with(request, Some("tuned")),
        Err(agentstack_model::engine::SubmitError::UnknownAdapter(_))
    ));
}

/// A partial rollout (issue 23): an adapter replaced while a sequence generates on it
/// takes over from the next token, and every token names the version that sampled it.
/// The tokens before the swap are those of a run never swapped, the versions never go
/// back, and the base weights' tokens name none. (The engine runs on its own thread, so
/// a try whose sequence finished before the swap landed is made again.)
#[tokio::test]
async fn a_sequence_continues_on_replaced_weights_and_its_tokens_name_them() {
    use agentstack_model::engine::Event;
    let f = fixture();
    let lm = Arc::new(LanguageModel::load(&f.gguf, WeightForm::Quantized).unwrap());
    let adapter = random_adapter(lm.model());
    let mut other = adapter.clone();
    for w in &mut other.weights {
        w.b = (&w.b * 3.0).unwrap();
    }
    let (first, second) = (
        adapter.apply(lm.model()).unwrap(),
        other.apply(lm.model()).unwrap(),
    );
    let request = GenerateRequest {
        sampling: SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            ..SamplingParams::default()
        },
        ignore_eos: true,
        ..GenerateRequest::greedy(vec![1, 2, 3, 4], CONTEXT - 8)
    };
    let mut swapped_mid_sequence = false;
    for _ in 0..5 {
        let engine = Engine::start(lm.clone(), EngineConfig::default());
        assert_eq!(engine.set_adapter("policy", first.clone()), 1);
        let unswapped = engine
            .generate_with(request.clone(), Some("policy"))
            .await
            .unwrap();
        let mut events = engine.submit_with(request.clone(), Some("policy")).unwrap();
        let (mut tokens, mut versions) = (Vec::new(), Vec::new());
        let mut swapped_after = None;
        while let Some(event) = events.recv().await {
            match event {
                Event::Token(t) => {
                    tokens.push(t.token.id);
                    versions.push(
                        t.weights_version
                            .expect("an adapter's token names its version"),
                    );
                    if swapped_after.is_none() {
                        assert_eq!(engine.set_adapter("policy", second.clone()), 2);
                        swapped_after = Some(tokens.len());
                    }
                }
                Event::Done(_) => break,
                Event::Error(e) => panic!("{e}"),
            }
        }
        assert_eq!(tokens.len(), CONTEXT - 8);
        assert!(versions.windows(2).all(|w| w[0] <= w[1]), "{versions:?}");
        assert_eq!(versions[0], 1);
        let old = versions.iter().filter(|&&v| v == 1).count();
        assert_eq!(
            tokens[..old],
            unswapped.tokens[..old],
            "before the swap, the same run"
        );
        if old < tokens.len() {
            swapped_mid_sequence = true;
            break;
        }
    }
    assert!(
        swapped_mid_sequence,
        "the swap never landed mid-sequence in 5 tries"
    );

    let engine = Engine::start(lm.clone(), EngineConfig::default());
    let mut events = engine.submit_with(request, None).unwrap();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token(t) => assert_eq!(t.weights_version, None),
            Event::Done(_) => break,
            Event::Error(e) => panic!("{e}"),
        }
    }
}

/// What the server answers to `request`: the status, the headers and the JSON body.
async fn send(
    state: &AppState,
    request: axum::http::Request<axum::body::Body>,
) -> (u16, axum::http::HeaderMap, Value) {
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A request bearing `key` (none: no `Authorization` header).
fn keyed(
    method: &str,
    uri: &str,
    body: Option<&Value>,
    key: Option<&str>,
) -> axum::http::Request<axum::body::Body> {
    let mut request = axum::http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    request
        .body(axum::body::Body::from(
            body.map(Value::to_string).unwrap_or_default(),
        ))
        .unwrap()
}

/// A tiny-model server whose keys are `keys` and whose adapter directory is `dir`.
fn guarded_state(f: &Fixture, keys: &[&str], dir: Option<&Path>) -> AppState {
    let lm = Arc::new(LanguageModel::load(&f.gguf, WeightForm::Quantized).unwrap());
    AppState::new(
        Engine::start(lm, EngineConfig::default()),
        None,
        ServerConfig {
            api_keys: keys.iter().map(|k| ApiKey::new(*k).unwrap()).collect(),
            adapter_dir: dir.map(Path::to_path_buf),
            ..ServerConfig::default()
        },
    )
}

/// Regression (issue 19): with API keys set, every route but `/health` answers 401 in
/// OpenAI's shape, with `WWW-Authenticate: Bearer`, to a request without a key or with
/// a wrong one, adapter loading and unloading included; a right key (any of them) is
/// served; without keys nothing is asked.
#[tokio::test]
async fn api_keys_guard_every_route_but_health() {
    let f = fixture();
    let dir = f._dir.path().join("adapters");
    std::fs::create_dir(&dir).unwrap();
    let lm = LanguageModel::load(&f.gguf, WeightForm::Quantized).unwrap();
    random_adapter(lm.model())
        .save(&dir.join("adapter.safetensors"))
        .unwrap();
    let state = guarded_state(&f, &["first-key", "second-key"], Some(&dir));
    let chat =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0});
    let generate = json!({"input_ids": [1, 2, 3], "max_tokens": 2, "temperature": 0});
    let load = json!({"name": "tuned", "path": "adapter.safetensors"});
    let routes: [(&str, &str, Option<&Value>); 9] = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", Some(&chat)),
        (
            "POST",
            "/v1/completions",
            Some(&json!({"prompt": "hi", "max_tokens": 2})),
        ),
        ("POST", "/generate", Some(&generate)),
        ("POST", "/tokenize", Some(&json!({"text": "hi"}))),
        ("GET", "/v1/adapters", None),
        ("POST", "/v1/adapters", Some(&load)),
        ("DELETE", "/v1/adapters/tuned", None),
        ("GET", "/no/such/route", None),
    ];
    for (method, uri, body) in routes {
        for key in [None, Some("wrong-key"), Some("first-ke")] {
            let (status, headers, answer) = send(&state, keyed(method, uri, body, key)).await;
            assert_eq!(status, 401, "{method} {uri} with {key:?}: {answer}");
            assert_eq!(headers["www-authenticate"], "Bearer", "{method} {uri}");
            assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
            assert!(
                answer["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("API key"),
                "{answer}"
            );
        }
    }
    let (_, _, listed) = send(
        &state,
        keyed("GET", "/v1/adapters", None, Some("first-key")),
    )
    .await;
    assert_eq!(listed["data"], json!([]), "nothing was loaded");
    let (status, _, health) = send(&state, keyed("GET", "/health", None, None)).await;
    assert_eq!(status, 200, "{health}");

    // The right keys are served, whatever the scheme's case.
    let (status, _, models) =
        send(&state, keyed("GET", "/v1/models", None, Some("first-key"))).await;
    assert_eq!(status, 200, "{models}");
    let lower = axum::http::Request::get("/v1/models")
        .header("authorization", "bearer second-key")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(send(&state, lower).await.0, 200);
    for (method, uri, body) in &routes[1..8] {
        let (status, _, answer) = send(&state, keyed(method, uri, *body, Some("second-key"))).await;
        assert_eq!(status, 200, "{method} {uri}: {answer}");
    }

    // Without keys, no key is asked for.
    let open = guarded_state(&f, &[], None);
    let (status, _, answer) = send(&open, keyed("POST", "/generate", Some(&generate), None)).await;
    assert_eq!(status, 200, "{answer}");
}

/// Regression (issue 19): a request without a key is refused before its body is read,
/// so an unauthenticated client cannot make the server take in a body; the body here
/// would be endless, and records whether it was ever polled. The same over a real
/// socket: a request announcing 10 GB gets its 401 at once.
#[tokio::test]
async fn a_request_without_a_key_is_refused_before_its_body_is_read() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let f = fixture();
    let state = guarded_state(&f, &["the-key"], Some(f._dir.path()));
    for uri in ["/v1/chat/completions", "/v1/adapters", "/generate"] {
        let polled = Arc::new(AtomicBool::new(false));
        let flag = polled.clone();
        let endless = futures_util::stream::repeat_with(move || {
            flag.store(true, Ordering::SeqCst);
            Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b' '; 1 << 20]))
        });
        let request = axum::http::Request::post(uri)
            .header("content-type", "application/json")
            .header("authorization", "Bearer not-the-key")
            .body(axum::body::Body::from_stream(endless))
            .unwrap();
        let (status, _, answer) = send(&state, request).await;
        assert_eq!(status, 401, "{uri}: {answer}");
        assert!(!polled.load(Ordering::SeqCst), "{uri}: the body was read");
    }

    let (address, server) = serve_on_loopback(state).await;
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    socket
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 10000000000\r\n\r\n{\"messages\": [")
        .await
        .unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), socket.read(&mut answer))
        .await
        .expect("the 401 comes without the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    server.abort();
}

/// Serves `state` on a free loopback port until the returned task is aborted.
async fn serve_on_loopback(
    state: AppState,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(agentstack_model::server::serve(
        state,
        listener,
        std::future::pending(),
    ));
    (address, server)
}

/// Regression (issue 19): a connection that never finished its request head was held
/// open forever; now the server closes it after the header-read timeout, and an idle
/// keep-alive connection too.
#[tokio::test]
async fn a_slow_request_head_is_closed_after_the_header_timeout() {
    const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(300);
    const GIVE_UP: std::time::Duration = std::time::Duration::from_secs(5);
    let f = fixture();
    let lm = Arc::new(LanguageModel::load(&f.gguf, WeightForm::Quantized).unwrap());
    let state = AppState::new(
        Engine::start(lm, EngineConfig::default()),
        None,
        ServerConfig {
            connections: agentstack_serve::Limits {
                header_read_timeout: HEADER_TIMEOUT,
                ..agentstack_serve::Limits::default()
            },
            ..ServerConfig::default()
        },
    );
    let (address, server) = serve_on_loopback(state).await;
    for partial in [&b"POST /v1/chat/completions HTTP/1.1\r\nhost: sl"[..], b""] {
        let closed = agentstack_serve::probe::time_to_close(address, partial, GIVE_UP)
            .await
            .unwrap();
        assert!(closed.is_some(), "held open after {partial:?}");
    }
    server.abort();
}

/// This process's resident memory in bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// The most a refused adapter load may add to the server's memory.
const REFUSED_LOAD_MEMORY: u64 = 64 << 20;

/// Regression (issue 19): adapters load only from inside `--adapter-dir`, and every
/// refusal about the file (an endless device, a FIFO, a directory, a missing file, a
/// `../` escape, an absolute path outside, a symlink out, a file of the wrong size)
/// is told with one and the same text, at once and without memory growth, even for a
/// valid adapter file that lies outside. A readable file whose tensors do not fit the
/// model says what is wrong (a rank above the layer's dimension, a huge shape in the
/// header); a valid adapter inside, named relatively or absolutely, loads and is used.
/// Without an adapter directory, loading is refused with a hint.
#[tokio::test]
async fn adapters_load_only_from_inside_the_adapter_directory() {
    let f = fixture();
    let root = f._dir.path();
    let dir = root.join("runs");
    std::fs::create_dir_all(dir.join("run")).unwrap();
    let lm = LanguageModel::load(&f.gguf, WeightForm::Quantized).unwrap();
    let adapter = random_adapter(lm.model());
    let inside = dir.join("run/adapter.safetensors");
    adapter.save(&inside).unwrap();
    adapter.save(&root.join("outside.safetensors")).unwrap();
    std::os::unix::fs::symlink(
        root.join("outside.safetensors"),
        dir.join("link.safetensors"),
    )
    .unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("zero.safetensors")).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(dir.join("fifo.safetensors"))
        .status()
        .unwrap();
    assert!(made.success());
    let mut longer = std::fs::read(&inside).unwrap();
    longer.extend_from_slice(&[0; 16]);
    std::fs::write(dir.join("longer.safetensors"), &longer).unwrap();
    std::fs::write(
        dir.join("shorter.safetensors"),
        &longer[..longer.len() - 40],
    )
    .unwrap();

    let state = guarded_state(&f, &[], Some(&dir));
    let load = |path: &Path| {
        let state = state.clone();
        let body = json!({"name": "tuned", "path": path});
        async move {
            tokio::time::timeout(
                std::time::Duration::from_secs(10),
                call(&state, "POST", "/v1/adapters", Some(body)),
            )
            .await
            .expect("a refusal comes at once")
        }
    };
    let before = resident_bytes();
    let refused = [
        PathBuf::from("/dev/zero"),
        PathBuf::from("zero.safetensors"),
        PathBuf::from("fifo.safetensors"),
        PathBuf::from("run"),
        dir.clone(),
        PathBuf::from("missing.safetensors"),
        PathBuf::from("../outside.safetensors"),
        PathBuf::from("run/../../outside.safetensors"),
        root.join("outside.safetensors"),
        PathBuf::from("link.safetensors"),
        PathBuf::from("/etc/passwd"),
        PathBuf::from("longer.safetensors"),
        PathBuf::from("shorter.safetensors"),
    ];
    for path in &refused {
        let (status, err) = load(path).await;
        assert_eq!(status, 400, "{}: {err}", path.display());
        assert_eq!(
            err["error"]["message"],
            "`path` does not name a loadable adapter file inside the server's adapter directory",
            "{}",
            path.display()
        );
        assert_eq!(err["error"]["param"], "path");
    }
    let grown = resident_bytes().saturating_sub(before);
    assert!(grown < REFUSED_LOAD_MEMORY, "refusals took {grown} bytes");
    let (_, listed) = call(&state, "GET", "/v1/adapters", None).await;
    assert_eq!(listed["data"], json!([]), "nothing was loaded");

    // Readable files whose tensors do not fit say why.
    let mut too_high = adapter.clone();
    for w in &mut too_high.weights {
        let (out, inp) = (w.b.dims()[0], w.a.dims()[1]);
        w.a = Tensor::zeros((40, inp), DType::F32, &Device::Cpu).unwrap();
        w.b = Tensor::zeros((out, 40), DType::F32, &Device::Cpu).unwrap();
    }
    too_high.rank = 40;
    too_high.save(&dir.join("rank.safetensors")).unwrap();
    assert_refused(
        &load(Path::new("rank.safetensors")).await,
        &["v_proj", "from 1 to 32"],
    );
    let header = json!({"blk.0.q_proj.lora_a": {"dtype": "F32", "shape": [1u64 << 40, HIDDEN], "data_offsets": [0, 0]}}).to_string();
    let mut huge = (header.len() as u64).to_le_bytes().to_vec();
    huge.extend_from_slice(header.as_bytes());
    std::fs::write(dir.join("huge.safetensors"), &huge).unwrap();
    assert_refused(
        &load(Path::new("huge.safetensors")).await,
        &["q_proj.lora_a"],
    );

    // A valid adapter inside loads, relatively or absolutely, and is used.
    let generate =
        json!({"input_ids": [1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (_, base) = call(&state, "POST", "/generate", Some(generate.clone())).await;
    for path in [PathBuf::from("run/adapter.safetensors"), inside.clone()] {
        let (status, loaded) = load(&path).await;
        assert_eq!(status, 200, "{}: {loaded}", path.display());
    }
    let mut tuned_request = generate.clone();
    tuned_request["model"] = json!("tuned");
    let (_, tuned) = call(&state, "POST", "/generate", Some(tuned_request)).await;
    assert_ne!(base["output_ids"], tuned["output_ids"]);

    // No adapter directory: no loading at all.
    let closed = guarded_state(&f, &[], None);
    let body = json!({"name": "tuned", "path": inside});
    let (status, err) = call(&closed, "POST", "/v1/adapters", Some(body)).await;
    assert_eq!(status, 403, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--adapter-dir"),
        "{err}"
    );
}

/// Per-position logits of `tokens` run in one pass from an empty cache.
fn one_pass(model: &agentstack_model::Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    model
        .forward(&mut [SeqInput {
            cache: &mut cache,
            tokens,
            logits: Logits::All,
        }])
        .unwrap()[0]
        .to_vec2()
        .unwrap()
}

fn assert_rows_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (x, y)) in got.iter().zip(want).enumerate() {
        assert!((x - y).abs() <= tolerance, "{what}, logit {i}: {x} vs {y}");
    }
}

/// The training path (adapters being trained, so their tensors carry gradients) and
/// the dense form without gradients share the same operations; a cache passes between
/// them. A sequence run in pieces, with gradients or without, gives the logits of one
/// pass; so do a group's completions run after their prompt in one batch (the rows a
/// loss reads), in both weight forms, and exactly in the quantized form, whose
/// kernels do not depend on the batch.
#[test]
fn dense_passes_in_pieces_and_shared_prompts_give_the_logits_of_one_pass() {
    let f = fixture();
    let dense = LanguageModel::load(&f.gguf, WeightForm::Dense(DType::F32)).unwrap();
    let quantized = LanguageModel::load(&f.hf, WeightForm::Quantized).unwrap();
    let plain = random_adapter(dense.model());
    let mut tracked = plain.clone();
    for w in &mut tracked.weights {
        w.a = candle_core::Var::from_tensor(&w.a)
            .unwrap()
            .as_tensor()
            .clone();
        w.b = candle_core::Var::from_tensor(&w.b)
            .unwrap()
            .as_tensor()
            .clone();
    }
    let training = tracked.apply(dense.model()).unwrap();
    let inference = plain.apply(dense.model()).unwrap();
    let tokens = dense.tokenizer().encode("pieces of it", false).unwrap();
    assert!(tokens.len() >= 8, "{tokens:?}");
    let whole = one_pass(&inference, &tokens);

    let mut cache = dense.model().new_cache();
    let mut rows = Vec::new();
    let n = tokens.len();
    for (model, range) in [(&training, 0..3), (&inference, 3..5), (&training, 5..n)] {
        let out = model
            .forward(&mut [SeqInput {
                cache: &mut cache,
                tokens: &tokens[range],
                logits: Logits::All,
            }])
            .unwrap();
        rows.extend(out[0].to_vec2::<f32>().unwrap());
    }
    for (i, (got, want)) in rows.iter().zip(&whole).enumerate() {
        assert_rows_close(got, want, 1e-4, &format!("position {i} in pieces"));
    }

    let prompt = &tokens[..4];
    let completions: [&[u32]; 3] = [&tokens[4..7], &tokens[4..5], &[tokens[6], tokens[2]]];
    for (model, tolerance) in [
        (&training, 1e-4),
        (&inference, 1e-4),
        (quantized.model(), 0.0),
    ] {
        let joined: Vec<Vec<f32>> = model
            .forward_completions(prompt, &completions)
            .unwrap()
            .to_vec2()
            .unwrap();
        assert_eq!(joined.len(), 1 + 2 + 1);
        let mut row = 1;
        for c in completions {
            let full: Vec<u32> = prompt.iter().chain(c).copied().collect();
            let alone = one_pass(model, &full);
            let last = prompt.len() - 1;
            assert_rows_close(&joined[0], &alone[last], tolerance, "the prompt's last row");
            for t in 1..c.len() {
                assert_rows_close(
                    &joined[row],
                    &alone[last + t],
                    tolerance,
                    "a completion row",
                );
                row += 1;
            }
        }
    }
}

/// RL rollouts are unchanged by speculative decoding: steps of sampled groups, each
/// step on new adapter weights (a learner's update), give the same tokens and
/// log-probabilities with speculation on and off, while drafts are tried and kept (so
/// the comparison is not vacuous). Where a model's passes are not exact in pieces
/// (float weights, the dense form) speculation stays off.
#[tokio::test]
async fn speculation_leaves_rl_rollouts_unchanged() {
    use agentstack_model::speculate::Speculation;
    let f = fixture();
    let q8 = q8_gguf(&f);
    let (mut drafted, mut kept) = (0, 0);
    for (file, form) in [
        (&q8, WeightForm::Quantized),
        (&f.gguf, WeightForm::Quantized),
        (&q8, WeightForm::Dense(DType::F32)),
    ] {
        let lm = Arc::new(LanguageModel::load(file, form).unwrap());
        let exact = lm.model().splits_exactly();
        assert_eq!(exact, file == &q8 && form == WeightForm::Quantized);
        let engines = [Speculation::default(), Speculation::off()].map(|speculation| {
            Engine::start(
                lm.clone(),
                EngineConfig {
                    speculation,
                    ..EngineConfig::default()
                },
            )
        });
        let mut adapter = random_adapter(lm.model());
        let prompts: [Vec<u32>; 3] = [
            vec![1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3],
            b"abcabcabcab".iter().map(|&b| u32::from(b)).collect(),
            vec![7, 9, 7, 9, 7, 9, 200, 201, 7, 9],
        ];
        for step in 0..3 {
            for w in &mut adapter.weights {
                w.b = (&w.b * 0.7).unwrap();
            }
            let weights = adapter.apply(lm.model()).unwrap();
            for engine in &engines {
                engine.set_adapter("policy", weights.clone());
            }
            // A group of 6 samples per prompt at RL's temperature 1, and lower.
            let requests: Vec<GenerateRequest> = prompts
                .iter()
                .flat_map(|prompt| {
                    (0..6u64).map(move |i| GenerateRequest {
                        sampling: SamplingParams {
                            temperature: [0.0, 0.3, 1.0][i as usize % 3],
                            seed: Some(100 * step + i),
                            ..SamplingParams::default()
                        },
                        ignore_eos: true,
                        top_logprobs: 2,
                        ..GenerateRequest::greedy(prompt.clone(), 40)
                    })
                })
                .collect();
            let mut outputs = Vec::new();
            for engine in &engines {
                let handles: Vec<_> = requests
                    .iter()
                    .cloned()
                    .map(|r| {
                        let engine = engine.clone();
                        tokio::spawn(async move {
                            engine.generate_with(r, Some("policy")).await.unwrap()
                        })
                    })
                    .collect();
                let mut outs = Vec::new();
                for handle in handles {
                    outs.push(handle.await.unwrap());
                }
                outputs.push(outs);
            }
            for (i, (on, off)) in outputs[0].iter().zip(&outputs[1]).enumerate() {
                assert_eq!(off.draft_tokens, 0);
                if !exact {
                    // Off; and the batches' last bits vary with timing (their
                    // passes are not exact in pieces), so no comparison.
                    assert_eq!(on.draft_tokens, 0);
                    continue;
                }
                drafted += on.draft_tokens;
                kept += on.accepted_draft_tokens;
                assert_eq!(
                    (&on.tokens, &on.logprobs, &on.top_logprobs, &on.text),
                    (&off.tokens, &off.logprobs, &off.top_logprobs, &off.text),
                    "{form:?}, step {step}, request {i}"
                );
            }
        }
    }
    assert!(
        drafted > 0 && kept > 0,
        "{kept} of {drafted} draft tokens kept"
    );
}

/// The server's `speculative` field: on, off and vLLM's knobs give the same answer,
/// with the drafts counted in `usage`; anything else is refused with what to send.
#[tokio::test]
async fn the_server_takes_speculative_per_request_and_refuses_bad_values() {
    let f = fixture();
    let q8 = q8_gguf(&f);
    let lm = Arc::new(LanguageModel::load(&q8, WeightForm::Quantized).unwrap());
    let state = AppState::new(
        Engine::start(lm, EngineConfig::default()),
        None,
        ServerConfig::default(),
    );
    let ask = |speculative: Option<Value>| {
        let mut body = json!({"prompt": "abcabcabcabcabc", "max_tokens": 40, "temperature": 0, "ignore_eos": true});
        if let Some(s) = speculative {
            body["speculative"] = s;
        }
        body
    };
    let mut texts = Vec::new();
    let mut drafted = 0;
    for speculative in [
        None,
        Some(json!(true)),
        Some(json!(false)),
        Some(json!({"num_speculative_tokens": 4, "prompt_lookup_min": 1})),
    ] {
        let off = speculative == Some(json!(false));
        let (status, answer) =
            call(&state, "POST", "/v1/completions", Some(ask(speculative))).await;
        assert_eq!(status, 200, "{answer}");
        let details = &answer["usage"]["completion_tokens_details"];
        let accepted = details["accepted_prediction_tokens"].as_u64().unwrap();
        let rejected = details["rejected_prediction_tokens"].as_u64().unwrap();
        if off {
            assert_eq!(accepted + rejected, 0, "{answer}");
        }
        drafted += accepted + rejected;
        texts.push(answer["choices"][0]["text"].clone());
    }
    assert!(drafted > 0);
    assert!(texts.windows(2).all(|w| w[0] == w[1]), "{texts:?}");
    for (bad, says) in [
        (json!("yes"), "must be true, false, or an object"),
        (json!({"num_speculative_tokens": 65}), "at most 64"),
        (
            json!({"prompt_lookup_min": 5, "prompt_lookup_max": 2}),
            "1 <= min <= max",
        ),
        (json!({"draft_model": "x"}), "unknown field `draft_model`"),
    ] {
        let refused = call(&state, "POST", "/v1/completions", Some(ask(Some(bad)))).await;
        assert_refused(&refused, &["speculative", says]);
    }
}

/// OpenAI's predicted outputs: a prediction of the answer makes its tokens drafts (from
/// the start, even where the server's default is off), the answer stays the same, and a
/// malformed prediction is refused.
#[tokio::test]
async fn a_prediction_drafts_the_answer_without_changing_it() {
    let f = fixture();
    let q8 = q8_gguf(&f);
    let lm = Arc::new(LanguageModel::load(&q8, WeightForm::Quantized).unwrap());
    let state = AppState::new(
        Engine::start(
            lm.clone(),
            EngineConfig {
                // Predictions draft even where the server's default is off.
                speculation: agentstack_model::speculate::Speculation::off(),
                ..EngineConfig::default()
            },
        ),
        None,
        ServerConfig::default(),
    );
    let ask = |prediction: Option<Value>| {
        let mut body = json!({"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 30, "temperature": 0, "ignore_eos": true});
        if let Some(p) = prediction {
            body["prediction"] = p;
        }
        body
    };
    let (status, plain) = call(&state, "POST", "/v1/chat/completions", Some(ask(None))).await;
    assert_eq!(status, 200, "{plain}");
    let text = plain["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let details = |answer: &Value, key: &str| {
        answer["usage"]["completion_tokens_details"][key]
            .as_u64()
            .unwrap()
    };
    assert_eq!(details(&plain, "accepted_prediction_tokens"), 0);
    for prediction in [
        json!({"type": "content", "content": text}),
        json!({"type": "content", "content": [{"type": "text", "text": text}]}),
    ] {
        let (status, answer) = call(
            &state,
            "POST",
            "/v1/chat/completions",
            Some(ask(Some(prediction))),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["choices"][0]["message"]["content"], text.as_str());
        // The random model's bytes are not UTF-8: its text does not tokenize back to
        // what it sampled, and the drafts are tried and missed.
        assert!(
            details(&answer, "rejected_prediction_tokens") > 0,
            "{answer}"
        );
    }
    // The sampled token ids as the prediction: drafted from the start and kept.
    let engine = Engine::start(lm, EngineConfig::default());
    let request = GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::greedy(vec![5, 6, 7], 30)
    };
    let alone = engine.generate(request.clone()).await.unwrap();
    let predicted = engine
        .generate(GenerateRequest {
            prediction: alone.tokens.clone(),
            ..request
        })
        .await
        .unwrap();
    assert_eq!(predicted.tokens, alone.tokens);
    assert_eq!(predicted.logprobs, alone.logprobs);
    // Every draft kept; how long the drafts were is the measured pass costs' call, but
    // each pass drafts at least two tokens while the answer follows the prediction.
    assert!(
        predicted.accepted_draft_tokens == predicted.draft_tokens
            && predicted.accepted_draft_tokens * 2 >= alone.tokens.len(),
        "{} of {} kept",
        predicted.accepted_draft_tokens,
        predicted.draft_tokens
    );
    for bad in [
        json!("text"),
        json!({"type": "file", "content": "x"}),
        json!({"type": "content", "content": [{"type": "image"}]}),
    ] {
        let refused = call(&state, "POST", "/v1/chat/completions", Some(ask(Some(bad)))).await;
        assert_refused(&refused, &["prediction"]);
    }
}
