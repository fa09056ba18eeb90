//! A model's tokenizer: the vocabulary in a GGUF file's metadata, run as llama.cpp runs it ([`super::gguf`]), or
//! the `tokenizer.json` a Hugging Face model directory ships, run by the `tokenizers` crate as it is.
//!
//! [`Tokenizer`] is what the rest of nightshift tokenizes and detokenizes with, whichever the model has.

use std::sync::Arc;

use serde_json::{json, Value};

use super::gguf;
use super::TokenizerError;

/// The tokenizer part of a model's metadata, free of any file format.
#[derive(Clone, Default)]
pub struct VocabMetadata {
    /// `tokenizer.ggml.model` (a GGUF file), or the `tokenizers` model type (`bpe`, `unigram`, ...).
    pub kind: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer (split rules) name.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Vec<i32>,
    /// Merges as "left right" (only for writing a vocabulary: [`byte_level_json`]).
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Extra end-of-generation tokens (e.g. `<|im_end|>` when it is not the EOS token).
    pub eot: Option<u32>,
    /// Further end-of-generation tokens (a Hugging Face `generation_config.json` may list several; llama.cpp's
    /// end-of-generation set of a GGUF vocabulary).
    pub more_ends: Vec<u32>,
    pub add_bos: bool,
    /// Whether an EOS token follows a prompt (llama.cpp's `add_eos`; T5-style encoders).
    pub add_eos: bool,
    pub chat_template: Option<String>,
    /// A complete tokenizer that came with the model (a Hugging Face `tokenizer.json`): [`build`] returns it, and
    /// `kind`, `pre` and `merges` only describe it. `tokens` and `token_types` are still filled from it (added
    /// special tokens as control tokens), for the stop rules and the chat template's BOS/EOS texts.
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// A GGUF file's vocabulary, ready to tokenize as llama.cpp does.
    pub gguf: Option<Arc<gguf::Vocab>>,
}

impl std::fmt::Debug for VocabMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VocabMetadata")
            .field("kind", &self.kind)
            .field("pre", &self.pre)
            .field("tokens", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .field("more_ends", &self.more_ends)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_BYTE: i32 = 6;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

impl VocabMetadata {
    /// The summary of a GGUF vocabulary: its tokens and types (llama.cpp's attributes as GGUF types), its special
    /// tokens, and every end-of-generation token llama.cpp finds in it.
    pub fn of_gguf(vocab: gguf::Vocab, meta: &gguf::Metadata, chat_template: Option<String>) -> VocabMetadata {
        let token_types = (0..vocab.len() as u32)
            .map(|id| {
                let a = vocab.attr(id);
                if a & gguf::attr::CONTROL != 0 {
                    TOKEN_TYPE_CONTROL
                } else if a & gguf::attr::USER_DEFINED != 0 {
                    TOKEN_TYPE_USER_DEFINED
                } else if a & gguf::attr::UNKNOWN != 0 {
                    2
                } else if a & gguf::attr::BYTE != 0 {
                    6
                } else if a & gguf::attr::UNUSED != 0 {
                    5
                } else {
                    1
                }
            })
            .collect();
        let specials = vocab.specials;
        let more_ends = vocab.end_of_generation.iter().copied().filter(|&id| Some(id) != specials.eos && Some(id) != specials.eot).collect();
        VocabMetadata {
            kind: meta.model.clone(),
            pre: vocab.pre_name().map(String::from).or_else(|| meta.pre.clone()),
            tokens: meta.tokens.clone(),
            token_types,
            merges: Vec::new(),
            bos: specials.bos,
            eos: specials.eos,
            eot: specials.eot,
            more_ends,
            add_bos: vocab.add_bos,
            add_eos: vocab.add_eos,
            chat_template,
            tokenizer: None,
            gguf: Some(Arc::new(vocab)),
        }
    }
}

/// A model's tokenizer, cheap to clone.
#[derive(Clone)]
pub enum Tokenizer {
    Gguf(Arc<gguf::Vocab>),
    Hf(Arc<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Gguf(v) => write!(f, "Tokenizer::Gguf({:?}, {} tokens)", v.kind(), v.len()),
            Tokenizer::Hf(_) => write!(f, "Tokenizer::Hf"),
        }
    }
}

/// Bytes as text, a malformed sequence as U+FFFD.
fn text_of(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl Tokenizer {
    /// Token ids of `text`, without BOS or EOS. With `parse_special`, the texts of control tokens in it
    /// (`<|im_start|>`) are those tokens; without, they are text like any other. (A `tokenizer.json` always
    /// parses its added tokens.)
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, String> {
        match self {
            Tokenizer::Gguf(v) => v.tokenize(text.as_bytes(), false, parse_special).map_err(|e| e.to_string()),
            Tokenizer::Hf(t) => t.encode_fast(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string()),
        }
    }

    /// Text of token ids. `skip_special` leaves out control tokens (a generated answer's text); without it, their
    /// texts are kept. A GGUF vocabulary detokenizes as llama.cpp's `llama_detokenize` (SentencePiece's leading
    /// space dropped, spaces before punctuation tidied where the vocabulary asks).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        match self {
            Tokenizer::Gguf(v) => text_of(v.detokenize(ids, false, !skip_special)),
            Tokenizer::Hf(t) => t.decode(ids, skip_special).unwrap_or_default(),
        }
    }

    /// One token's text as an answer shows it when it is the first token (`first`) or a later one; `None` where
    /// the tokenizer has no byte-exact piece per token (a `tokenizer.json`: decode sequences instead).
    fn piece(&self, id: u32, first: bool) -> Option<Vec<u8>> {
        let Tokenizer::Gguf(v) = self else { return None };
        let piece = v.detokenize(&[id], false, false);
        Some(if first { piece } else { v.piece(id, false).to_vec() })
    }

    /// One token's text with special tokens' texts kept (log-probabilities name tokens so).
    pub fn token_text(&self, id: u32) -> String {
        match self {
            Tokenizer::Gguf(v) => String::from_utf8_lossy(v.piece(id, true)).into_owned(),
            Tokenizer::Hf(t) => t.decode(&[id], false).unwrap_or_default(),
        }
    }

    /// Tokens the tokenizer knows (the model may have more rows of logits).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gguf(v) => v.len(),
            Tokenizer::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// Each token's bytes as a grammar engine (llguidance) sees them: special tokens' texts behind a 0xFF marker,
    /// every other token's bytes as it decodes.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>, String> {
        match self {
            Tokenizer::Gguf(v) => Ok((0..v.len() as u32)
                .map(|id| {
                    if v.attr(id) & (gguf::attr::CONTROL | gguf::attr::UNKNOWN) != 0 {
                        [&[toktrie::TokTrie::SPECIAL_TOKEN_MARKER][..], v.token_text(id).unwrap_or_default()].concat()
                    } else {
                        v.piece(id, true).to_vec()
                    }
                })
                .collect()),
            Tokenizer::Hf(t) => {
                let spec: Value = serde_json::from_str(&t.to_string(false).map_err(|e| format!("cannot serialise the tokenizer: {e}"))?)
                    .map_err(|e| format!("cannot read the serialised tokenizer: {e}"))?;
                let mut words = llguidance::token_bytes_from_tokenizer_json(&spec).map_err(|e| format!("cannot map the tokenizer's tokens to bytes: {e:#}"))?;
                words.resize(words.len().max(t.get_vocab_size(true)), Vec::new());
                Ok(words)
            }
        }
    }

    /// The `tokenizers` tokenizer, for callers that need its own API (encoders, truncation).
    pub fn hf(&self) -> Option<&tokenizers::Tokenizer> {
        match self {
            Tokenizer::Hf(t) => Some(t),
            Tokenizer::Gguf(_) => None,
        }
    }

    /// The GGUF vocabulary, where the tokenizer is one.
    pub fn gguf(&self) -> Option<&gguf::Vocab> {
        match self {
            Tokenizer::Gguf(v) => Some(v),
            Tokenizer::Hf(_) => None,
        }
    }
}

/// Incremental detokenization of generated tokens, for stop strings: emits text only once the bytes decoded so
/// far form complete characters (a multi-byte character can span tokens). A GGUF vocabulary's pieces are appended
/// as bytes, the first one as llama.cpp's detokenizer starts an answer (without SentencePiece's leading space).
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Bytes of a GGUF vocabulary's pieces not yet emitted (an incomplete character).
    pending: Vec<u8>,
    started: bool,
}

impl TextStream {
    /// Adds a token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        if let Some(piece) = tokenizer.piece(id, !self.started) {
            self.started = true;
            self.pending.extend_from_slice(&piece);
            return match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    let text = text.to_string();
                    self.pending.clear();
                    text
                }
                // An incomplete character at the end waits for the next piece; a malformed one is U+FFFD.
                Err(e) if e.error_len().is_none() => {
                    let valid = e.valid_up_to();
                    let text = std::str::from_utf8(&self.pending[..valid]).expect("valid").to_string();
                    self.pending.drain(..valid);
                    text
                }
                Err(_) => text_of(std::mem::take(&mut self.pending)),
            };
        }
        self.ids.push(id);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], true);
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], true);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            full[prefix.len()..].to_string()
        } else {
            String::new()
        }
    }
}

/// GPT-2's split rule, as in `tokenizers`' ByteLevel pre-tokenizer.
fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

/// Reads a Hugging Face `tokenizer.json`. The `tokenizers` crate panics on some malformed files (a decoder that
/// does not parse); that is an error here like any other. Errors name no path: the caller's do.
pub fn from_file(path: &std::path::Path) -> Result<tokenizers::Tokenizer, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    crate::panics::catch_panic(|| text.parse::<tokenizers::Tokenizer>()).and_then(|parsed| parsed.map_err(|e| e.to_string()))
}

/// The model's tokenizer: the `tokenizer.json` it came with, or its GGUF vocabulary.
pub fn build(meta: &VocabMetadata) -> Result<Tokenizer, TokenizerError> {
    if let Some(tokenizer) = &meta.tokenizer {
        return Ok(Tokenizer::Hf(Arc::clone(tokenizer)));
    }
    if let Some(vocab) = &meta.gguf {
        return Ok(Tokenizer::Gguf(Arc::clone(vocab)));
    }
    Err(TokenizerError::Invalid("the model has no tokenizer".into()))
}

/// A byte-level BPE vocabulary (GPT-2's split rule, `pre = "gpt2"`) as a `tokenizer.json`: what `synth-model` writes
/// into a Hugging Face directory.
pub fn byte_level_json(meta: &VocabMetadata) -> Result<tokenizers::Tokenizer, TokenizerError> {
    if meta.tokens.is_empty() {
        return Err(TokenizerError::Invalid("the vocabulary is empty".into()));
    }
    let mut vocab = serde_json::Map::with_capacity(meta.tokens.len());
    for (id, token) in meta.tokens.iter().enumerate() {
        vocab.insert(token.clone(), json!(id));
    }
    if vocab.len() != meta.tokens.len() {
        return Err(TokenizerError::Invalid("the vocabulary has duplicate tokens".into()));
    }
    let added: Vec<Value> = meta
        .token_types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
        .filter_map(|(id, &t)| {
            meta.tokens.get(id).map(|content| {
                json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": t == TOKEN_TYPE_CONTROL})
            })
        })
        .collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level(true),
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": meta.merges},
    });
    spec.to_string().parse::<tokenizers::Tokenizer>().map_err(|e| TokenizerError::Invalid(e.to_string()))
}
