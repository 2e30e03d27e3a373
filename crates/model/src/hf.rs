//! Hugging Face checkpoints: a directory with `config.json`, `tokenizer.json`,
//! `tokenizer_config.json` (chat template, special tokens) and `*.safetensors` weights.
//!
//! The weights load in either form: dense as stored (converted to the requested float
//! type), or quantized to Q8_0 at load for inference.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::Value as Json;

use crate::config::{Architecture, ModelConfig};
use crate::error::{ModelError, Result};
use crate::kernels::FastLinear;
use crate::model::{Block, Embedding, Linear, Model, WeightForm};

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::BadMetadata {
        key: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// What a checkpoint directory holds besides the weights.
pub(crate) struct HfFiles {
    pub config: ModelConfig,
    pub tokenizer_json: std::path::PathBuf,
    pub tokenizer_config: Json,
    pub model_config: Json,
}

pub(crate) fn read_files(dir: &Path) -> Result<HfFiles> {
    let model_config = read_json(&dir.join("config.json"))?;
    let config = ModelConfig::from_hf_json(&model_config)?;
    let tokenizer_config = if dir.join("tokenizer_config.json").is_file() {
        read_json(&dir.join("tokenizer_config.json"))?
    } else {
        Json::Null
    };
    Ok(HfFiles {
        config,
        tokenizer_json: dir.join("tokenizer.json"),
        tokenizer_config,
        model_config,
    })
}

/// The chat template of `tokenizer_config.json` (a string, or a list of named ones of
/// which `default` is used).
pub(crate) fn chat_template(tokenizer_config: &Json) -> Option<String> {
    match tokenizer_config.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// A special token's text in `tokenizer_config.json` (a string or `{"content": …}`).
pub(crate) fn special_token(tokenizer_config: &Json, key: &str) -> Option<String> {
    match tokenizer_config.get(key)? {
        Json::String(s) => Some(s.clone()),
        other => other
            .get("content")
            .and_then(Json::as_str)
            .map(str::to_owned),
    }
}

/// Loads every `*.safetensors` file of `dir`.
pub(crate) fn load_tensors(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|source| ModelError::Io {
            path: dir.to_path_buf(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::BadTensor {
            name: dir.display().to_string(),
            reason: "no *.safetensors files in the checkpoint directory".into(),
        });
    }
    let mut tensors = HashMap::new();
    for file in files {
        let loaded = candle_core::safetensors::load(&file, &Device::Cpu).map_err(|source| {
            ModelError::Gguf {
                path: file.clone(),
                source,
            }
        })?;
        tensors.extend(loaded);
    }
    Ok(tensors)
}

struct Weights {
    tensors: HashMap<String, Tensor>,
    form: WeightForm,
}

impl Weights {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::BadTensor {
                name: name.to_owned(),
                reason: "missing from the checkpoint".into(),
            })?;
        if t.dims() != shape {
            return Err(ModelError::BadTensor {
                name: name.to_owned(),
                reason: format!("shape {:?}, expected {shape:?}", t.dims()),
            });
        }
        Ok(t)
    }

    fn float(&self) -> DType {
        match self.form {
            WeightForm::Dense(dtype) => dtype,
            WeightForm::Quantized => DType::F32,
        }
    }

    fn norm(&mut self, name: &str, size: usize) -> Result<Tensor> {
        let dtype = self.float();
        Ok(self.take(name, &[size])?.to_dtype(dtype)?)
    }

    fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let weight = self.take(&format!("{name}.weight"), &[out, inp])?;
        let dtype = self.float();
        let bias = if bias {
            Some(
                self.take(&format!("{name}.bias"), &[out])?
                    .to_dtype(dtype)?,
            )
        } else {
            None
        };
        Ok(match self.form {
            WeightForm::Dense(dtype) => Linear::Dense {
                weight: weight.to_dtype(dtype)?,
                bias,
            },
            WeightForm::Quantized => Linear::Fast {
                weight: Arc::new(quantize(&weight)?),
                bias,
            },
        })
    }
}

fn quantize(weight: &Tensor) -> Result<FastLinear> {
    let q = QTensor::quantize(&weight.to_dtype(DType::F32)?, GgmlDType::Q8_0)?;
    FastLinear::from_qtensor(&q)
}

/// Builds the model from Hugging Face tensor names.
pub(crate) fn model_from_tensors(
    config: ModelConfig,
    tensors: HashMap<String, Tensor>,
    form: WeightForm,
) -> Result<Model> {
    let mut w = Weights { tensors, form };
    let (h, hd) = (config.hidden_size, config.head_dim);
    let (q_dim, kv_dim) = (config.heads * hd, config.kv_heads * hd);
    let bias = config.architecture == Architecture::Qwen2;
    let qk_norm = config.architecture == Architecture::Qwen3;
    let mut blocks = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        let p = format!("model.layers.{i}");
        blocks.push(Block {
            attn_norm: w.norm(&format!("{p}.input_layernorm.weight"), h)?,
            q: w.linear(&format!("{p}.self_attn.q_proj"), q_dim, h, bias)?,
            k: w.linear(&format!("{p}.self_attn.k_proj"), kv_dim, h, bias)?,
            v: w.linear(&format!("{p}.self_attn.v_proj"), kv_dim, h, bias)?,
            o: w.linear(&format!("{p}.self_attn.o_proj"), h, q_dim, false)?,
            q_norm: if qk_norm {
                Some(w.norm(&format!("{p}.self_attn.q_norm.weight"), hd)?)
            } else {
                None
            },
            k_norm: if qk_norm {
                Some(w.norm(&format!("{p}.self_attn.k_norm.weight"), hd)?)
            } else {
                None
            },
            ffn_norm: w.norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            gate: w.linear(&format!("{p}.mlp.gate_proj"), config.ffn_size, h, false)?,
            up: w.linear(&format!("{p}.mlp.up_proj"), config.ffn_size, h, false)?,
            down: w.linear(&format!("{p}.mlp.down_proj"), h, config.ffn_size, false)?,
        });
    }
    let norm = w.norm("model.norm.weight", h)?;
    let embed = w.take("model.embed_tokens.weight", &[config.vocab_size, h])?;
    let tied = !w.tensors.contains_key("lm_head.weight");
    let output = if tied {
        match form {
            WeightForm::Dense(dtype) => Linear::Dense {
                weight: embed.to_dtype(dtype)?,
                bias: None,
            },
            WeightForm::Quantized => Linear::Fast {
                weight: Arc::new(quantize(&embed)?),
                bias: None,
            },
        }
    } else {
        w.linear("lm_head", config.vocab_size, h, false)?
    };
    let embedding = match (&output, form) {
        (Linear::Fast { weight, .. }, WeightForm::Quantized) if tied => {
            Embedding::Fast(weight.clone())
        }
        (_, WeightForm::Quantized) => Embedding::Fast(Arc::new(quantize(&embed)?)),
        (_, WeightForm::Dense(dtype)) => Embedding::Dense(embed.to_dtype(dtype)?),
    };
    Ok(Model::assemble(config, form, embedding, blocks, norm, output)?.with_tied_output(tied))
}
