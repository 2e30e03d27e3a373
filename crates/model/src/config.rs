//! Architecture hyperparameters, read from GGUF metadata or a Hugging Face `config.json`.

use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// The model families this runtime implements. They share one forward pass and differ
/// in a few switches (biases on q/k/v, norms on q/k, rotary layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama, Mistral, SmolLM and their relatives.
    Llama,
    /// Qwen2 and Qwen2.5: biases on the q, k and v projections.
    Qwen2,
    /// Qwen3 (dense): RMS norms on q and k per head, no biases.
    Qwen3,
}

impl Architecture {
    /// Parses GGUF's `general.architecture` or a Hugging Face `model_type`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "llama" | "mistral" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            other => Err(ModelError::UnsupportedArchitecture(other.to_owned())),
        }
    }

    /// The name GGUF uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }
}

/// How rotary position embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeLayout {
    /// Adjacent pairs (x0, x1), (x2, x3)…: llama.cpp's "normal" rope. GGUF llama files
    /// store q and k permuted for this layout.
    Interleaved,
    /// First half against second half: GPT-NeoX style, used by Hugging Face checkpoints
    /// and by Qwen in both formats.
    Halves,
}

/// Hyperparameters of one model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    /// The family.
    pub architecture: Architecture,
    /// Tokens in the vocabulary (rows of the embedding).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (fewer than `heads` with grouped-query attention).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Width of the feed-forward layer.
    pub ffn_size: usize,
    /// Epsilon of the RMS norms.
    pub rms_eps: f64,
    /// Base frequency of the rotary embedding.
    pub rope_theta: f64,
    /// Pairing of dimensions in the rotary embedding.
    pub rope_layout: RopeLayout,
    /// The context window the model was trained for.
    pub context_length: usize,
}

impl ModelConfig {
    /// Reads the hyperparameters of a GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let name = file.string("general.architecture")?;
        let architecture = Architecture::parse(name)?;
        let key = |suffix: &str| format!("{name}.{suffix}");
        let hidden_size = file.usize(&key("embedding_length"))?;
        let heads = file.usize(&key("attention.head_count"))?;
        let kv_heads = file
            .usize_opt(&key("attention.head_count_kv"))?
            .unwrap_or(heads);
        let head_dim = match file.usize_opt(&key("attention.key_length"))? {
            Some(d) => d,
            None if heads > 0 => hidden_size / heads,
            None => 0,
        };
        let vocab_size = match file.usize_opt(&key("vocab_size"))? {
            Some(v) => v,
            None => file.array("tokenizer.ggml.tokens")?.len(),
        };
        let config = Self {
            architecture,
            vocab_size,
            hidden_size,
            layers: file.usize(&key("block_count"))?,
            heads,
            kv_heads,
            head_dim,
            ffn_size: file.usize(&key("feed_forward_length"))?,
            rms_eps: file
                .f64_opt(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope_theta: file.f64_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_layout: match architecture {
                Architecture::Llama => RopeLayout::Interleaved,
                Architecture::Qwen2 | Architecture::Qwen3 => RopeLayout::Halves,
            },
            context_length: file.usize_opt(&key("context_length"))?.unwrap_or(2048),
        };
        config.validate()?;
        Ok(config)
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_json(json: &serde_json::Value) -> Result<Self> {
        let get = |key: &str| -> Result<usize> {
            json.get(key)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::MissingMetadata {
                    key: format!("config.json: {key}"),
                })
        };
        let model_type = json
            .get("model_type")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| ModelError::MissingMetadata {
                key: "config.json: model_type".into(),
            })?;
        let architecture = Architecture::parse(model_type)?;
        let hidden_size = get("hidden_size")?;
        let heads = get("num_attention_heads")?;
        let config = Self {
            architecture,
            vocab_size: get("vocab_size")?,
            hidden_size,
            layers: get("num_hidden_layers")?,
            heads,
            kv_heads: get("num_key_value_heads").unwrap_or(heads),
            head_dim: get("head_dim").unwrap_or(hidden_size / heads.max(1)),
            ffn_size: get("intermediate_size")?,
            rms_eps: json
                .get("rms_norm_eps")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(1e-5),
            rope_theta: json
                .get("rope_theta")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(10_000.0),
            rope_layout: RopeLayout::Halves,
            context_length: get("max_position_embeddings").unwrap_or(2048),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the values are consistent with each other.
    pub fn validate(&self) -> Result<()> {
        let fail = |key: &str, reason: String| {
            Err(ModelError::BadMetadata {
                key: key.to_owned(),
                reason,
            })
        };
        if self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 || self.layers == 0 {
            return fail(
                "attention.head_count",
                "heads, kv heads, head width and layers must be positive".into(),
            );
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return fail(
                "attention.head_count_kv",
                format!(
                    "{} query heads are not a multiple of {} kv heads",
                    self.heads, self.kv_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(
                "attention.key_length",
                format!("head width {} is odd", self.head_dim),
            );
        }
        if self.vocab_size == 0 || self.hidden_size == 0 {
            return fail(
                "embedding_length",
                "vocabulary and width must be positive".into(),
            );
        }
        Ok(())
    }
}
