//! Open models on local hardware.
//!
//! `agentstack-model` loads llama-family GGUF files (Llama, SmolLM, Mistral; Qwen2 and
//! Qwen3 through the same forward pass), tokenizes exactly as llama.cpp does, renders the
//! model's chat template, runs a batched forward pass with per-sequence KV caches, and
//! samples with the usual controls and log-probabilities. The [`engine`] batches
//! concurrent requests continuously; the [`server`] speaks the OpenAI API plus a
//! token-in-token-out `/generate`. Quantized weights run on the [`kernels`], repacked
//! once per file and kept in the [`repack_cache`], which later loads map.
//!
//! ```no_run
//! use agentstack_model::{LanguageModel, WeightForm, generate::{GenerateRequest, generate}};
//!
//! let lm = LanguageModel::load("SmolLM2-135M-Instruct.Q4_1.gguf", WeightForm::Quantized)?;
//! let prompt = lm.tokenizer().encode("The capital of France is", false)?;
//! let out = generate(&lm, &GenerateRequest::greedy(prompt, 16))?;
//! println!("{}", lm.tokenizer().decode(&out.tokens, true));
//! # Ok::<(), agentstack_model::ModelError>(())
//! ```

pub mod adapter;
pub mod chat;
pub mod config;
pub mod constraint;
pub mod engine;
mod error;
pub mod generate;
pub mod gguf;
pub mod grad;
mod hf;
pub mod kernels;
pub mod model;
pub mod pull;
pub mod repack_cache;
pub mod sampling;
pub mod server;
pub mod speculate;
pub mod tokenizer;

use std::path::{Path, PathBuf};

use serde::Serialize;

pub use crate::chat::{ChatTemplate, Message};
pub use crate::config::{Architecture, ModelConfig};
pub use crate::error::{ModelError, Result};
pub use crate::gguf::GgufFile;
pub use crate::model::{Logits, MatmulObserver, Model, SeqCache, SeqInput, WeightForm, with_f32};
pub use crate::repack_cache::RepackCache;
pub use crate::sampling::{SamplingParams, TokenLogprob};
pub use crate::tokenizer::Tokenizer;

/// The earlier turn a chat prompt continues (see
/// [`LanguageModel::chat_prompt_continuing`]).
#[derive(Debug, Clone, Copy)]
pub struct EarlierTurn<'a> {
    /// The messages that turn's prompt was made from.
    pub messages: &'a [Message],
    /// Its prompt's token ids.
    pub prompt: &'a [u32],
    /// The token ids it generated, as sampled.
    pub completion: &'a [u32],
}

/// A model ready to use: weights, tokenizer and chat template.
#[derive(Debug, Clone)]
pub struct LanguageModel {
    model: Model,
    tokenizer: Tokenizer,
    template: std::sync::Arc<ChatTemplate>,
    info: ModelInfo,
}

/// What a model file holds, for `model info` and `/v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    /// The file.
    pub path: PathBuf,
    /// `general.name`, or the file name.
    pub name: String,
    /// File size in bytes.
    pub file_bytes: u64,
    /// Hyperparameters.
    pub config: ModelConfig,
    /// Parameters.
    pub parameters: u64,
    /// Tensor count per GGML type.
    pub tensor_types: std::collections::BTreeMap<String, usize>,
    /// Parameters per GGML type.
    pub parameters_by_type: std::collections::BTreeMap<String, u64>,
    /// Whether the output layer reuses the embedding table.
    pub tied_embeddings: bool,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Whether the chat template is the model's own (false: ChatML fallback).
    pub has_chat_template: bool,
}

impl ModelInfo {
    /// Reads the description of a GGUF file without loading its weights.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let config = ModelConfig::from_gguf(file)?;
        let mut tensor_types = std::collections::BTreeMap::new();
        let mut parameters_by_type = std::collections::BTreeMap::new();
        let mut parameters = 0u64;
        for (dtype, shape) in file.tensors().values() {
            let n: u64 = shape.iter().map(|&d| d as u64).product();
            let key = dtype.to_string();
            *tensor_types.entry(key.clone()).or_default() += 1;
            *parameters_by_type.entry(key).or_default() += n;
            parameters += n;
        }
        let name = file
            .string_opt("general.name")?
            .map(str::to_owned)
            .unwrap_or_else(|| {
                file.path()
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            });
        Ok(Self {
            path: file.path().to_path_buf(),
            name,
            file_bytes: file.size(),
            vocab_size: config.vocab_size,
            config,
            parameters,
            tensor_types,
            parameters_by_type,
            tied_embeddings: !file.has_tensor("output.weight"),
            has_chat_template: file.get("tokenizer.chat_template").is_some(),
        })
    }
}

impl LanguageModel {
    /// Loads a GGUF file, or a Hugging Face checkpoint directory (`config.json`,
    /// `tokenizer.json`, `*.safetensors`; quantized to Q8_0 at load in the quantized
    /// form).
    pub fn load(path: impl AsRef<Path>, form: WeightForm) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            return Self::load_hf(path, form);
        }
        let mut file = GgufFile::open(path)?;
        let info = ModelInfo::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let model = Model::from_gguf(&mut file, form)?;
        let piece = |id: Option<u32>| {
            id.and_then(|id| tokenizer.piece(id))
                .unwrap_or_default()
                .to_owned()
        };
        let template = ChatTemplate::new(
            file.string_opt("tokenizer.chat_template")?,
            &piece(tokenizer.bos()),
            &piece(tokenizer.eos()),
        )?;
        Ok(Self {
            model,
            tokenizer,
            template: std::sync::Arc::new(template),
            info,
        })
    }

    fn load_hf(dir: &Path, form: WeightForm) -> Result<Self> {
        let files = hf::read_files(dir)?;
        let tokenizer = Tokenizer::from_hf_file(
            &files.tokenizer_json,
            &files.tokenizer_config,
            &files.model_config,
        )?;
        let source = hf::chat_template(&files.tokenizer_config);
        let piece = |id: Option<u32>| {
            id.and_then(|id| tokenizer.piece(id))
                .unwrap_or_default()
                .to_owned()
        };
        let template = ChatTemplate::new(
            source.as_deref(),
            &piece(tokenizer.bos()),
            &piece(tokenizer.eos()),
        )?;
        let tensors = hf::load_tensors(dir)?;
        let mut parameters_by_type = std::collections::BTreeMap::new();
        let mut tensor_types = std::collections::BTreeMap::new();
        let mut parameters = 0u64;
        for t in tensors.values() {
            let key = format!("{:?}", t.dtype()).to_uppercase();
            *tensor_types.entry(key.clone()).or_insert(0) += 1;
            *parameters_by_type.entry(key).or_insert(0) += t.elem_count() as u64;
            parameters += t.elem_count() as u64;
        }
        let tied_embeddings = !tensors.contains_key("lm_head.weight");
        let file_bytes = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        let info = ModelInfo {
            path: dir.to_path_buf(),
            name: dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            file_bytes,
            vocab_size: files.config.vocab_size,
            config: files.config.clone(),
            parameters,
            tensor_types,
            parameters_by_type,
            tied_embeddings,
            has_chat_template: source.is_some(),
        };
        let model = hf::model_from_tensors(files.config, tensors, form)?;
        Ok(Self {
            model,
            tokenizer,
            template: std::sync::Arc::new(template),
            info,
        })
    }

    /// The network.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The prompt token ids of a chat, ready for generation: `messages` rendered with
    /// the chat template and its generation prompt. `tools` (OpenAI tool definitions)
    /// go to the template when it renders tools itself; otherwise they, and earlier
    /// calls and results, are written into the messages in the Hermes convention
    /// (`<tools>`, `<tool_call>`, `<tool_response>`). `model serve` builds its chat
    /// prompts here, so an in-process caller gets the very same tokens.
    pub fn chat_prompt(
        &self,
        messages: Vec<Message>,
        tools: &[serde_json::Value],
    ) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, tools, true)?;
        self.tokenizer.encode(&text, true)
    }

    /// The prompt of the next turn of a conversation whose earlier turn had the token
    /// ids `earlier.prompt` and `earlier.completion` (as sampled): those ids exactly,
    /// then what the chat template writes after an assistant turn's content (its
    /// end-of-turn, less an end token the completion already holds), the new messages
    /// and the generation prompt, tokenized on their own. No earlier token is tokenized
    /// again: a sampled token sequence is often not what the tokenizer would make of its
    /// text, and a multi-turn RL sample must keep the ids the policy produced. The
    /// assistant message in `messages` stands for the completion whatever its text (a
    /// harness may store it trimmed, or with tool calls taken out).
    ///
    /// `messages` must be the earlier turn's messages, that assistant message and more;
    /// the second value says whether the prompt continued. It does not when `messages`
    /// is not that (the history was truncated or compacted), or the template renders
    /// the conversation so that its earlier part changes, and the prompt is then
    /// [`Self::chat_prompt`]'s.
    pub fn chat_prompt_continuing(
        &self,
        earlier: &EarlierTurn<'_>,
        messages: Vec<Message>,
        tools: &[serde_json::Value],
    ) -> Result<(Vec<u32>, bool)> {
        let n = earlier.messages.len();
        let extends = messages.len() > n + 1
            && messages[..n] == *earlier.messages
            && messages[n].role == "assistant";
        if extends && let Some(rest) = self.after_assistant_turn(earlier, &messages, tools)? {
            let mut ids = Vec::with_capacity(
                earlier.prompt.len() + earlier.completion.len() + rest.len() / 2,
            );
            ids.extend_from_slice(earlier.prompt);
            ids.extend_from_slice(earlier.completion);
            ids.extend(self.tokenizer.encode_without_bos(&rest, true)?);
            return Ok((ids, true));
        }
        Ok((self.chat_prompt(messages, tools)?, false))
    }

    /// The text that follows the earlier turn's completion in a continued prompt (see
    /// [`Self::chat_prompt_continuing`]): the template's end of an assistant turn after
    /// its content (without the end token the completion ends with, if it does), then
    /// the messages after `messages[earlier.messages.len()]` and the generation prompt.
    /// `None` when the template does not render the conversation that way.
    fn after_assistant_turn(
        &self,
        earlier: &EarlierTurn<'_>,
        messages: &[Message],
        tools: &[serde_json::Value],
    ) -> Result<Option<String>> {
        const MARK: &str = "agentstack-assistant-content-7f3a";
        let n = earlier.messages.len();
        let full = self.render_chat(messages.to_vec(), tools, true)?;
        let through = self.render_chat(messages[..=n].to_vec(), tools, false)?;
        let Some(rest) = full.strip_prefix(through.as_str()) else {
            return Ok(None);
        };
        // The end of an assistant turn, as the template writes it after the content.
        let mut marked = earlier.messages.to_vec();
        marked.push(Message::new("assistant", MARK));
        let marked = self.render_chat(marked, tools, false)?;
        let Some((_, mut closing)) = marked.split_once(MARK) else {
            return Ok(None);
        };
        if let Some(&last) = earlier.completion.last()
            && self.tokenizer.end_tokens().contains(&last)
        {
            let end = self.tokenizer.decode(&[last], false);
            match closing.strip_prefix(end.as_str()) {
                Some(after) => closing = after,
                None => return Ok(None),
            }
        }
        Ok(Some(format!("{closing}{rest}")))
    }

    /// A chat rendered as [`Self::chat_prompt`] renders it, with or without the
    /// generation prompt.
    fn render_chat(
        &self,
        messages: Vec<Message>,
        tools: &[serde_json::Value],
        generation_prompt: bool,
    ) -> Result<String> {
        let template = &self.template;
        let native_tools = template.handles_tools() && !template.is_fallback();
        let messages = if native_tools {
            messages
        } else {
            chat::lower_tools(messages, if template.is_fallback() { &[] } else { tools })
        };
        let tools_arg =
            (!tools.is_empty() && (native_tools || template.is_fallback())).then_some(tools);
        template.render(&messages, tools_arg, generation_prompt)
    }

    /// The file's description.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Scores a whole sequence in one pass: the log-probability of each token given the
    /// ones before it (the first token has none and is left out).
    pub fn score(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Ok(Vec::new());
        }
        let mut cache = self.model.new_cache();
        let logits = self.model.forward(&mut [SeqInput {
            cache: &mut cache,
            tokens: &tokens[..tokens.len() - 1],
            logits: Logits::All,
        }])?;
        let rows: Vec<Vec<f32>> = logits[0].to_vec2()?;
        Ok(rows
            .iter()
            .zip(&tokens[1..])
            .map(|(row, &next)| sampling::log_softmax(row)[next as usize])
            .collect())
    }

    /// Scores several completions of one prompt: the log-probability of each completion
    /// token given the prompt and the completion's tokens before it. The prompt is read
    /// once and the completions run as one batch; only their own rows go through the
    /// output layer. The values are those of [`Self::score`] on each whole sequence.
    pub fn score_completions(
        &self,
        prompt: &[u32],
        completions: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>> {
        if prompt.is_empty() {
            return Err(ModelError::InvalidRequest(
                "scoring completions needs a prompt of at least one token".into(),
            ));
        }
        let vocab = self.model.config().vocab_size;
        if let Some(bad) = completions
            .iter()
            .flat_map(|c| c.iter())
            .find(|&&t| t as usize >= vocab)
        {
            return Err(ModelError::InvalidRequest(format!(
                "token id {bad} is out of range; the vocabulary has {vocab} tokens (0..{vocab})"
            )));
        }
        let logits: Vec<Vec<f32>> = self
            .model
            .forward_completions(prompt, completions)?
            .to_vec2()?;
        let normalized: Vec<Vec<f32>> = logits.iter().map(|r| sampling::log_softmax(r)).collect();
        let mut rows = Model::completion_rows(completions).into_iter();
        Ok(completions
            .iter()
            .map(|c| {
                c.iter()
                    .zip(rows.by_ref())
                    .map(|(&token, row)| normalized[row][token as usize])
                    .collect()
            })
            .collect())
    }
}
