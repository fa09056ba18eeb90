//! A `tokenizers` tokenizer built from the vocabulary in a model file's metadata (GGUF `tokenizer.ggml.*`), or
//! the one a Hugging Face model directory ships (`tokenizer.json`), used as it is.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is supported, with the pre-tokenizers whose split rules
//! are known exactly. An unknown pre-tokenizer is an error, never a silent fallback to plain GPT-2 splitting:
//! that would change token ids for any text with digits (SmolLM2's `smollm` splits every digit on its own).

use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::TokenizerError;

/// The tokenizer part of a model's metadata, free of any file format.
#[derive(Clone, Debug, Default)]
pub struct VocabMetadata {
    /// `tokenizer.ggml.model`: the tokenizer kind.
    pub kind: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer (split rules) name.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Vec<i32>,
    /// Merges as "left right".
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Extra end-of-generation tokens (e.g. `<|im_end|>` when it is not the EOS token).
    pub eot: Option<u32>,
    /// Further end-of-generation tokens (a Hugging Face `generation_config.json` may list several).
    pub more_ends: Vec<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
    /// A complete tokenizer that came with the model (a Hugging Face `tokenizer.json`): [`build`] returns it, and
    /// `kind`, `pre` and `merges` only describe it. `tokens` and `token_types` are still filled from it (added
    /// special tokens as control tokens), for the stop rules and the chat template's BOS/EOS texts.
    pub tokenizer: Option<std::sync::Arc<Tokenizer>>,
}

pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// GPT-2's split rule, as in `tokenizers`' ByteLevel pre-tokenizer.
fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn pre_tokenizer(pre: &str) -> Result<Value, TokenizerError> {
    Ok(match pre {
        // GPT-2 splitting.
        "gpt2" | "default" => byte_level(true),
        // SmolLM: every digit on its own, then GPT-2 splitting (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM).
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": false},
            byte_level(true),
        ]}),
        other => return Err(TokenizerError::UnsupportedPre(other.to_string())),
    })
}

/// Reads a Hugging Face `tokenizer.json`. The `tokenizers` crate panics on some malformed files (a decoder that
/// does not parse); that is an error here like any other. Errors name no path: the caller's do.
pub fn from_file(path: &std::path::Path) -> Result<Tokenizer, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    crate::error::catch_panic(|| text.parse::<Tokenizer>()).and_then(|parsed| parsed.map_err(|e| e.to_string()))
}

pub fn build(meta: &VocabMetadata) -> Result<Tokenizer, TokenizerError> {
    if let Some(tokenizer) = &meta.tokenizer {
        return Ok(Tokenizer::clone(tokenizer));
    }
    if meta.kind != "gpt2" {
        return Err(TokenizerError::UnsupportedKind(meta.kind.clone()));
    }
    if meta.tokens.is_empty() {
        return Err(TokenizerError::Invalid("the vocabulary is empty".into()));
    }
    let pre = pre_tokenizer(meta.pre.as_deref().unwrap_or("default"))?;
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
        "pre_tokenizer": pre,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": meta.merges},
    });
    spec.to_string().parse::<Tokenizer>().map_err(|e| TokenizerError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(kind: &str, pre: Option<&str>) -> VocabMetadata {
        VocabMetadata {
            kind: kind.into(),
            pre: pre.map(Into::into),
            tokens: ["a", "b", "ab", "1", "2", "<|end|>", "12"].map(String::from).to_vec(),
            token_types: vec![1, 1, 1, 1, 1, TOKEN_TYPE_CONTROL, 1],
            merges: vec!["a b".into(), "1 2".into()],
            ..VocabMetadata::default()
        }
    }

    #[test]
    fn other_tokenizer_kinds_and_pre_tokenizers_are_refused_by_name() {
        let e = build(&tiny("llama", None)).unwrap_err().to_string();
        assert!(e.contains("`llama`"), "{e}");
        let e = build(&tiny("gpt2", Some("llama-bpe"))).unwrap_err().to_string();
        assert!(e.contains("`llama-bpe`"), "{e}");
    }

    #[test]
    fn merges_digits_and_control_tokens_apply() {
        let t = build(&tiny("gpt2", Some("smollm"))).unwrap();
        assert_eq!(t.encode_fast("ab", false).unwrap().get_ids(), &[2]);
        // smollm isolates every digit before BPE, so the "1 2" merge never applies; plain GPT-2 splitting merges it.
        assert_eq!(t.encode_fast("12", false).unwrap().get_ids(), &[3, 4]);
        let gpt2 = build(&tiny("gpt2", Some("gpt2"))).unwrap();
        assert_eq!(gpt2.encode_fast("12", false).unwrap().get_ids(), &[6]);
        assert_eq!(t.encode_fast("ab<|end|>", false).unwrap().get_ids(), &[2, 5]);
        assert_eq!(t.decode(&[2, 5], true).unwrap(), "ab");
    }
}
