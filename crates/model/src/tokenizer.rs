//! A tokenizer built from GGUF metadata that matches llama.cpp token for token.
//!
//! GGUF files carry the vocabulary, the merges and the name of the pre-tokenizer
//! (`tokenizer.ggml.pre`); llama.cpp maps that name to a list of split regexes. We build
//! the same pipeline with the `tokenizers` crate: one isolated `Split` per regex, in
//! llama.cpp's order, then GPT-2 byte-level encoding without a prefix space, then BPE.
//! Control and user-defined tokens are added tokens, parsed out of the text only when
//! asked to (llama.cpp's `parse_special`).

use std::collections::HashMap;

use serde_json::Value as Json;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// llama.cpp's `llama_token_type`, stored in `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// Ordinary text.
    Normal,
    /// The unknown token.
    Unknown,
    /// Control tokens such as `<|im_start|>`: never produced from text unless special
    /// tokens are parsed, rendered as nothing unless asked.
    Control,
    /// Tokens added by the model's authors; always parsed out of text.
    UserDefined,
    /// Unused slots.
    Unused,
    /// A raw byte (`<0x0A>`), SentencePiece style.
    Byte,
}

impl TokenKind {
    fn from_gguf(value: i64) -> Self {
        match value {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }

    /// Whether this is a special token (control, user-defined, unknown or unused).
    pub fn is_special(self) -> bool {
        !matches!(self, Self::Normal | Self::Byte)
    }
}

/// A text ↔ token-id mapping for one model.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Tokenizer with special-token parsing turned off, for `parse_special = false`.
    literal: tokenizers::Tokenizer,
    pieces: Vec<String>,
    bytes: Vec<Vec<u8>>,
    kinds: Vec<TokenKind>,
    by_piece: HashMap<String, u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.pieces.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// The split regexes llama.cpp uses for a `tokenizer.ggml.pre` name
/// (`llm_tokenizer_bpe` in `llama-vocab.cpp`).
fn pre_tokenizer_regexes(pre: &str) -> Result<&'static [&'static str]> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Ok(match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            &[r"\p{N}", GPT2]
        }
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" | "trillion" => &[GPT2],
        "llama3" | "llama-bpe" | "llama-v3" | "falcon3" | "pixtral" | "smaug-bpe" => &[LLAMA3],
        "qwen2" | "qwen" | "stablelm2" | "hunyuan" | "deepseek-r1-qwen" => &[QWEN2],
        "default" => &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        other => {
            return Err(ModelError::Tokenizer(format!(
                "pre-tokenizer `{other}` is not supported yet (supported: smollm, gpt2, llama3, qwen2 and their aliases)"
            )));
        }
    })
}

/// GPT-2's byte ↔ printable-character table: bytes that are printable map to themselves,
/// the rest to U+0100 onwards.
fn byte_level_table() -> HashMap<char, u8> {
    let mut printable: Vec<u8> = (b'!'..=b'~').collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut table = HashMap::with_capacity(256);
    let mut next = 0u32;
    for byte in 0..=255u8 {
        let ch = if printable.contains(&byte) {
            char::from(byte)
        } else {
            let ch = char::from_u32(256 + next).expect("U+0100..U+0143 are chars");
            next += 1;
            ch
        };
        table.insert(ch, byte);
    }
    table
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.string("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer model `{model}` is not supported yet (supported: gpt2 byte-level BPE, used by SmolLM, Llama 3 and Qwen)"
            )));
        }
        let pre = file.string_opt("tokenizer.ggml.pre")?.unwrap_or("default");
        let pieces: Vec<String> = file
            .array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<_, _>>()
            .map_err(|_| ModelError::BadMetadata {
                key: "tokenizer.ggml.tokens".into(),
                reason: "expected an array of strings".into(),
            })?;
        let merges: Vec<String> = file
            .array("tokenizer.ggml.merges")?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<_, _>>()
            .map_err(|_| ModelError::BadMetadata {
                key: "tokenizer.ggml.merges".into(),
                reason: "expected an array of strings".into(),
            })?;
        let kinds: Vec<TokenKind> = match file.get("tokenizer.ggml.token_type") {
            None => vec![TokenKind::Normal; pieces.len()],
            Some(_) => file
                .array("tokenizer.ggml.token_type")?
                .iter()
                .map(|v| {
                    v.to_i32()
                        .map(|v| TokenKind::from_gguf(i64::from(v)))
                        .or_else(|_| v.to_u32().map(|v| TokenKind::from_gguf(i64::from(v))))
                })
                .collect::<Result<_, _>>()
                .map_err(|_| ModelError::BadMetadata {
                    key: "tokenizer.ggml.token_type".into(),
                    reason: "expected an array of integers".into(),
                })?,
        };
        if kinds.len() != pieces.len() {
            return Err(ModelError::BadMetadata {
                key: "tokenizer.ggml.token_type".into(),
                reason: format!("{} types for {} tokens", kinds.len(), pieces.len()),
            });
        }
        let id = |key: &str| -> Result<Option<u32>> {
            Ok(file
                .usize_opt(key)?
                .map(|v| v as u32)
                .filter(|&v| (v as usize) < pieces.len()))
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let eot = id("tokenizer.ggml.eot_token_id")?;
        let add_bos = file
            .bool_opt("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false);
        let ignore_merges = matches!(pre, "llama3" | "llama-bpe" | "llama-v3");
        Self::build(
            pieces,
            &merges,
            kinds,
            pre_tokenizer_regexes(pre)?,
            ignore_merges,
            (bos, eos, eot, add_bos),
        )
    }

    fn build(
        pieces: Vec<String>,
        merges: &[String],
        kinds: Vec<TokenKind>,
        regexes: &[&str],
        ignore_merges: bool,
        (bos, eos, eot, add_bos): (Option<u32>, Option<u32>, Option<u32>, bool),
    ) -> Result<Self> {
        // Built through the library's own types rather than a tokenizer.json string:
        // serializing ~50k pieces and merges to JSON and parsing them back was a tenth
        // of a 1B model's load time. Same model, pre-tokenizer, decoder and special
        // tokens as that JSON would describe.
        let bad = |e: tokenizers::Error| {
            ModelError::Tokenizer(format!("cannot build BPE from GGUF: {e}"))
        };
        let vocab: tokenizers::models::bpe::Vocab = pieces
            .iter()
            .enumerate()
            .map(|(id, piece)| (piece.clone(), id as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| ModelError::BadMetadata {
                        key: "tokenizer.ggml.merges".into(),
                        reason: format!("merge `{m}` is not two pieces separated by a space"),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = tokenizers::models::bpe::BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(bad)?;
        let byte_level =
            tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, false, false);
        let mut pre: Vec<tokenizers::PreTokenizerWrapper> = regexes
            .iter()
            .map(|r| {
                tokenizers::pre_tokenizers::split::Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex((*r).to_owned()),
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map(Into::into)
            })
            .collect::<tokenizers::Result<_>>()
            .map_err(bad)?;
        pre.push(byte_level.into());
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(tokenizers::pre_tokenizers::sequence::Sequence::new(
                pre,
            )))
            .with_decoder(Some(byte_level));
        let added: Vec<tokenizers::AddedToken> = pieces
            .iter()
            .zip(&kinds)
            .filter(|(_, kind)| matches!(kind, TokenKind::Control | TokenKind::UserDefined))
            .map(|(piece, _)| tokenizers::AddedToken::from(piece.clone(), true))
            .collect();
        inner.add_tokens(&added);
        Ok(Self::assemble(
            inner,
            pieces,
            kinds,
            true,
            (bos, eos, eot, add_bos),
        ))
    }

    /// Loads a Hugging Face `tokenizer.json` (byte-level BPE, or SentencePiece-style with
    /// `▁` and byte-fallback tokens), with special tokens from `tokenizer_config.json`
    /// and ids from `config.json`.
    pub fn from_hf_file(
        path: &std::path::Path,
        tokenizer_config: &Json,
        model_config: &Json,
    ) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let spec: Json = serde_json::from_str(&text)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let inner: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let vocab = spec
            .pointer("/model/vocab")
            .and_then(Json::as_object)
            .ok_or_else(|| {
                ModelError::Tokenizer(
                    "tokenizer.json has no model.vocab map (only BPE tokenizers are supported)"
                        .into(),
                )
            })?;
        let added = spec
            .get("added_tokens")
            .and_then(Json::as_array)
            .cloned()
            .unwrap_or_default();
        let size = vocab
            .values()
            .filter_map(Json::as_u64)
            .chain(
                added
                    .iter()
                    .filter_map(|t| t.get("id").and_then(Json::as_u64)),
            )
            .max()
            .map_or(0, |m| m as usize + 1);
        let mut pieces = vec![String::new(); size];
        let mut kinds = vec![TokenKind::Unused; size];
        for (piece, id) in vocab {
            if let Some(id) = id.as_u64() {
                pieces[id as usize] = piece.clone();
                kinds[id as usize] = TokenKind::Normal;
            }
        }
        for token in &added {
            let (Some(id), Some(content)) = (
                token.get("id").and_then(Json::as_u64),
                token.get("content").and_then(Json::as_str),
            ) else {
                continue;
            };
            pieces[id as usize] = content.to_owned();
            kinds[id as usize] = if token
                .get("special")
                .and_then(Json::as_bool)
                .unwrap_or(false)
            {
                TokenKind::Control
            } else {
                TokenKind::UserDefined
            };
        }
        let byte_level = spec.to_string().contains("\"ByteLevel\"");
        let lookup = |key: &str, id_key: &str| -> Option<u32> {
            crate::hf::special_token(tokenizer_config, key)
                .and_then(|piece| pieces.iter().position(|p| *p == piece))
                .map(|i| i as u32)
                .or_else(|| {
                    model_config
                        .get(id_key)
                        .and_then(Json::as_u64)
                        .map(|v| v as u32)
                })
        };
        let bos = lookup("bos_token", "bos_token_id");
        let eos = lookup("eos_token", "eos_token_id");
        let add_bos = tokenizer_config
            .get("add_bos_token")
            .and_then(Json::as_bool)
            .unwrap_or(false);
        Ok(Self::assemble(
            inner,
            pieces,
            kinds,
            byte_level,
            (bos, eos, None, add_bos),
        ))
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        pieces: Vec<String>,
        kinds: Vec<TokenKind>,
        byte_level: bool,
        (bos, eos, eot, add_bos): (Option<u32>, Option<u32>, Option<u32>, bool),
    ) -> Self {
        let mut literal = inner.clone();
        literal.set_encode_special_tokens(true);
        let table = byte_level_table();
        let bytes = pieces
            .iter()
            .zip(&kinds)
            .map(|(piece, kind)| {
                if kind.is_special() {
                    piece.as_bytes().to_vec()
                } else if byte_level {
                    // A piece outside the byte-level alphabet is kept as its UTF-8.
                    piece
                        .chars()
                        .map(|c| table.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        .unwrap_or_else(|| piece.as_bytes().to_vec())
                } else if let Some(hex) =
                    piece.strip_prefix("<0x").and_then(|p| p.strip_suffix('>'))
                {
                    u8::from_str_radix(hex, 16)
                        .map_or_else(|_| piece.as_bytes().to_vec(), |b| vec![b])
                } else {
                    piece.replace('\u{2581}', " ").into_bytes()
                }
            })
            .collect();
        let by_piece = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (p.clone(), i as u32))
            .collect();
        Self {
            inner,
            literal,
            pieces,
            bytes,
            kinds,
            by_piece,
            bos,
            eos,
            eot,
            add_bos,
        }
    }

    /// Encodes `text`. With `parse_special`, control tokens written in the text (such as
    /// `<|im_start|>`) become their ids, as llama.cpp does for chat prompts; without it
    /// they are tokenized as plain text. `add_bos` follows the model's metadata.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let tokenizer = if parse_special {
            &self.inner
        } else {
            &self.literal
        };
        let encoding = tokenizer
            .encode_fast(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// [`Self::encode`] without the beginning-of-sequence token: the tokens of text
    /// that follows others (the next turn of a conversation).
    pub fn encode_without_bos(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = self.encode(text, parse_special)?;
        if self.add_bos && self.bos.is_some() && !ids.is_empty() {
            ids.remove(0);
        }
        Ok(ids)
    }

    /// The bytes token `id` stands for (special tokens: their text).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(Vec::as_slice)
    }

    /// Decodes `ids` to text; special tokens are left out when `skip_special`. Bytes that
    /// do not form UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(self.token_bytes(id).unwrap_or_default());
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The piece (vocabulary string) of `id`.
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// The id of a vocabulary piece, such as `<|im_end|>`.
    pub fn piece_id(&self, piece: &str) -> Option<u32> {
        self.by_piece.get(piece).copied()
    }

    /// Whether `id` is a special (control, user-defined, unknown or unused) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.kinds.get(id as usize).is_some_and(|k| k.is_special())
    }

    /// The kind of token `id`.
    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Tokens that end a generation: EOS, end-of-turn, and the chat-format closers
    /// (`<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`) the vocabulary has.
    pub fn end_tokens(&self) -> Vec<u32> {
        let mut ends: Vec<u32> = self.eos.into_iter().chain(self.eot).collect();
        for piece in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>"] {
            if let Some(id) = self.piece_id(piece)
                && self.is_special(id)
                && !ends.contains(&id)
            {
                ends.push(id);
            }
        }
        ends
    }
}

/// Turns a stream of token ids into a stream of text, holding back bytes until they form
/// whole UTF-8 characters.
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    /// Adds the bytes of one token; returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // Invalid, not merely incomplete: give up on those bytes.
            Err(_) => self.pending.len(),
        };
        let text = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        self.pending.drain(..valid);
        text
    }

    /// Whatever is still held back, lossily.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let table = byte_level_table();
        assert_eq!(table.len(), 256);
        let mut seen = [false; 256];
        for &b in table.values() {
            seen[b as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(table[&'Ġ'], b' ');
        assert_eq!(table[&'Ċ'], b'\n');
    }

    #[test]
    fn text_stream_holds_back_partial_characters() {
        let mut stream = TextStream::default();
        let euro = "€".as_bytes();
        assert_eq!(stream.push(&euro[..1]), "");
        assert_eq!(stream.push(&euro[1..]), "€");
        assert_eq!(stream.push(b"ab"), "ab");
        assert_eq!(stream.push(&[0xE2]), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
    }
}
