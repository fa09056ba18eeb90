//! GGUF's tokenizers, as llama.cpp reads and runs them: the vocabulary in a GGUF file's `tokenizer.ggml.*` metadata
//! becomes a [`Vocab`] that tokenizes and detokenizes exactly as llama.cpp does, token for token and byte for byte.
//!
//! Every tokenizer kind llama.cpp reads from GGUF that nightshift's models use:
//! - `gpt2`: byte-level BPE, with the pre-tokenizer `tokenizer.ggml.pre` names ([`pre_tokenizer`]); `gemma4` too,
//!   BPE over SentencePiece-style pieces.
//! - `llama`: SentencePiece BPE by token scores, with byte fallback (`<0xXX>`), spaces as `▁` and a space
//!   before the text (`add_space_prefix`).
//! - `bert`: WordPiece with BERT's normaliser.
//! - `t5`: Unigram, with SentencePiece's precompiled normaliser.
//!
//! llama.cpp's vocabulary loader also decides things the file does not say: token attributes (control, user-defined,
//! byte, unused; `lstrip`/`rstrip` for some models), end-of-generation tokens found by their text (`<|im_end|>`,
//! `<end_of_turn>`, ...), per-pre-tokenizer defaults (`add_bos` for Llama 3, `clean_spaces`). [`Vocab::new`] makes
//! the same decisions, so that the special tokens a chat template writes are parsed, and generation ends, as in
//! llama.cpp.
//!
//! Not followed exactly: llama.cpp picks the EOT and FIM token ids by text in its hash map's order; here the first
//! text of its list that the vocabulary has wins (`<|eot_id|>` before `<|im_end|>` before `<|end|>` before
//! `<|endoftext|>`), which is what llama.cpp picks on every vocabulary checked (Llama 3, Qwen2, Phi-3). Every
//! candidate is an end-of-generation token either way. Special tokens of equal length are tried in id order (llama.cpp
//! sorts them unstably); that matters only for two such tokens that overlap in one text.

mod bpe;
mod spm;
pub mod split;
mod ugm;
pub mod unicode;
#[rustfmt::skip]
mod unicode_data;
mod wpm;

use std::collections::{BTreeSet, HashMap, HashSet};

use aho_corasick::AhoCorasick;

/// Token attributes, llama.cpp's `llama_token_attr` bits.
pub mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
    pub const LSTRIP: u32 = 1 << 7;
    pub const RSTRIP: u32 = 1 << 8;
}

/// The tokenizer metadata of a GGUF file, as read (keys absent are `None`).
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    /// `tokenizer.ggml.model`.
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    pub merges: Option<Vec<String>>,
    pub precompiled_charsmap: Option<Vec<u8>>,
    /// The special token ids the file states (`tokenizer.ggml.bos_token_id`, ...).
    pub ids: Specials,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_sep: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub remove_extra_whitespaces: Option<bool>,
    pub lowercase: Option<bool>,
    pub strip_accents: Option<bool>,
    /// `general.name` and `general.architecture`: llama.cpp sets some token attributes by model name.
    pub name: Option<String>,
    pub architecture: Option<String>,
}

/// A vocabulary llama.cpp would refuse, or one this implementation does not run.
#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    #[error("tokenizer kind `{0}` is not supported (supported: gpt2, llama, bert, t5, gemma4)")]
    UnsupportedKind(String),
    #[error("pre-tokenizer `{0}` is not supported (supported: {list})", list = PRE_TOKENIZERS.iter().map(|p| p.names[0]).collect::<Vec<_>>().join(", "))]
    UnsupportedPre(String),
    #[error("the model's tokenizer is invalid: {0}")]
    Invalid(String),
}

/// A text that could not be tokenized.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TokenizeError(String);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Spm,
    Bpe,
    Wpm,
    Ugm,
}

/// One of llama.cpp's pre-tokenizer types: the names that select it, its expressions, and what it changes of the
/// BPE defaults.
pub struct PreTokenizer {
    pub names: &'static [&'static str],
    pub expressions: &'static [&'static str],
    pub byte_encode: bool,
    pub ignore_merges: bool,
    /// Whether the detokenizer tidies spaces before punctuation (`clean_spaces`, on by default for BPE).
    pub clean_spaces: bool,
    /// Adds BOS by default (before `tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    pub add_sep: bool,
    /// Spaces as `▁` (SentencePiece-style BPE).
    pub escape_whitespaces: bool,
    /// The BOS token is none (ChatGLM).
    pub no_bos: bool,
}

const fn pre(names: &'static [&'static str], expressions: &'static [&'static str]) -> PreTokenizer {
    PreTokenizer { names, expressions, byte_encode: true, ignore_merges: false, clean_spaces: true, add_bos: false, add_sep: false, escape_whitespaces: false, no_bos: false }
}

const GPT2: &str = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
const LLAMA3: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const GPT4O: &str = "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const DEEPSEEK3: [&str; 3] = [
    "\\p{N}{1,3}",
    "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const STARCODER: [&str; 2] = ["\\p{N}", GPT2];

/// llama.cpp's pre-tokenizer types, by the `tokenizer.ggml.pre` names that select them (first name: the one the
/// docs/models.md lists). The expressions are llama.cpp's (its adaptations of each model's tokenizer.json).
pub static PRE_TOKENIZERS: &[PreTokenizer] = &[
    PreTokenizer { add_bos: true, ignore_merges: true, ..pre(&["llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"], &[LLAMA3]) },
    pre(&["default"], &["[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2, "\\p{N}+", "[0-9][0-9][0-9]"]),
    PreTokenizer { clean_spaces: false, ..pre(&["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], &[QWEN2]) },
    pre(&["megrez", "stablelm2"], &[QWEN2]),
    PreTokenizer { clean_spaces: false, ..pre(&["qwen35"], &["(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]) },
    pre(&["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"], &[GPT2]),
    PreTokenizer { add_sep: true, ..pre(&["roberta-bpe", "jina-v1-en", "jina-v2-code"], &[GPT2]) },
    PreTokenizer { clean_spaces: false, ..pre(&["deepseek-llm"], &[
        "[\r\n]",
        "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
        "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
        "\\s+$",
        "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
        "\\p{N}+",
    ]) },
    PreTokenizer { clean_spaces: false, ..pre(&["deepseek-coder"], &["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+", "\\p{N}"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], &DEEPSEEK3) },
    PreTokenizer { clean_spaces: false, ignore_merges: true, add_bos: true, ..pre(&["tekken"], &["[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], &[GPT4O]) },
    PreTokenizer { clean_spaces: false, ..pre(&["smollm"], &STARCODER) },
    PreTokenizer { clean_spaces: false, ..pre(&["command-r"], &STARCODER) },
    pre(&["starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"], &STARCODER),
    pre(&["falcon"], &["[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2, "[0-9][0-9][0-9]"]),
    pre(&["dbrx", "smaug-bpe"], &[LLAMA3]),
    PreTokenizer { no_bos: true, ..pre(&["chatglm-bpe"], &[LLAMA3]) },
    PreTokenizer { no_bos: true, ignore_merges: true, ..pre(&["glm4", "glm5"], &[LLAMA3]) },
    PreTokenizer { clean_spaces: false, ..pre(&["poro-chat"], &[" ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+"]) },
    pre(&["bloom", "gpt3-finnish"], &[" ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+"]),
    PreTokenizer { clean_spaces: false, ..pre(&["viking"], &[" ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+", "\\p{N}"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["tiny_aya", "cohere2moe"], &[
        "\\d{1,3}(?=(?:\\d{3})*\\b)",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ]) },
    PreTokenizer { clean_spaces: false, ..pre(&["superbpe"], &["\\p{N}+", "(?=(\\d{3})+(?!\\d))"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["bailingmoe", "bailingmoe2", "llada-moe"], &["'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["seed-coder"], &["(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["hunyuan", "solar-open", "grok-2"], &[QWEN2]) },
    PreTokenizer { clean_spaces: false, ..pre(&["ufakzeka"], &["[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["afmoe"], &[
        "\\p{AFMoE_digits}",
        "[\u{4E00}-\u{9FFF}\u{3400}-\u{4DBF}\u{8C48}-\u{FAFF}\u{3040}-\u{309F}\u{30A0}-\u{30FF}\u{FF65}-\u{FF9F}\u{2F00}-\u{2FDF}\u{E40}-\u{E7F}\u{E80}-\u{EFF}\u{1780}-\u{17FF}\u{1000}-\u{109F}\u{AA60}-\u{AA7F}\u{A9E0}-\u{A9FF}\u{AC00}-\u{D7AF}\u{1100}-\u{11FF}]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ]) },
    PreTokenizer { clean_spaces: false, ..pre(&["laguna"], &["[^\\n]+|[\\n]+", QWEN2]) },
    pre(&["exaone-moe"], &["(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"]),
    pre(&["jais-2"], &["(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}"]),
    PreTokenizer { ignore_merges: true, ..pre(&["minicpm5"], &["\\p{N}{1,3}", "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]) },
    PreTokenizer { clean_spaces: false, ..pre(&["spark2_5"], &["\\p{N}{1,3}", "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+", "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+", "\\p{N}"]) },
    PreTokenizer { clean_spaces: false, ignore_merges: true, ..pre(&["youtu"], &[
        "[\u{AC00}-\u{D7A3}\u{3131}-\u{318E}]+|[\u{FF01}\u{2026}\u{201C}\u{201D}\u{2018}\u{2019}\u{2014}\u{FF1A}\u{FF1B}\u{FF0C}\u{3001}-\u{303F}\u{FE30}-\u{FE4F}]+|[\u{3105}-\u{312F}]+|[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ]) },
    PreTokenizer { clean_spaces: false, ignore_merges: true, ..pre(&["granite-embed-multi-97m"], &["[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]) },
    PreTokenizer { clean_spaces: false, add_bos: true, ..pre(&["chameleon"], &[
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        "\\p{N}",
        "[\\p{P}!-/:-@\\[-`{-~]",
        GPT2,
    ]) },
    PreTokenizer { byte_encode: false, escape_whitespaces: true, ..pre(&["gemma4", "granite-embed-multi-311m"], &["[^\\n]+|[\\n]+"]) },
    PreTokenizer { byte_encode: false, escape_whitespaces: true, clean_spaces: false, ..pre(&["sarvam-moe"], &["[^\\n]+|[\\n]+"]) },
];

/// The pre-tokenizer type a `tokenizer.ggml.pre` name selects (no name: `default`).
pub fn pre_tokenizer(name: Option<&str>) -> Option<&'static PreTokenizer> {
    let name = match name {
        None | Some("") => "default",
        Some(n) => n,
    };
    PRE_TOKENIZERS.iter().find(|p| p.names.contains(&name))
}

struct Token {
    text: Box<[u8]>,
    score: f32,
    attr: u32,
}

enum Algorithm {
    Spm,
    Bpe { merges: bpe::Merges, splitter: split::Splitter, ignore_merges: bool, whole_newlines: bool },
    Wpm { options: wpm::Options },
    Ugm { charsmap: Option<ugm::Charsmap>, user_defined_prefixes: HashSet<Vec<u8>>, unknown_score: f64, options: ugm::Options },
}

/// The special tokens' ids; `None` where the vocabulary has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Specials {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unknown: Option<u32>,
    pub separator: Option<u32>,
    pub padding: Option<u32>,
    pub mask: Option<u32>,
    pub fim_pre: Option<u32>,
    pub fim_suf: Option<u32>,
    pub fim_mid: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

/// A GGUF vocabulary, ready to tokenize.
pub struct Vocab {
    kind: Kind,
    pre: Option<&'static PreTokenizer>,
    tokens: Vec<Token>,
    ids: HashMap<Box<[u8]>, u32>,
    max_token_len: usize,
    algorithm: Algorithm,
    pub specials: Specials,
    /// Tokens that end generation.
    pub end_of_generation: BTreeSet<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_sep: bool,
    add_space_prefix: bool,
    escape_whitespaces: bool,
    clean_spaces: bool,
    /// Control, user-defined and unknown tokens, longest text first: the order the text is split at them.
    special_tokens: Vec<u32>,
    /// All of `special_tokens`' texts, to find which occur in a text in one pass.
    special_finder: Option<AhoCorasick>,
    /// Each token's text as llama.cpp's `token_to_piece(special = true)` gives it.
    pieces: Vec<Box<[u8]>>,
}

/// The EOT candidates llama.cpp recognises by text.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
    "<\u{FF5C}end\u{2581}of\u{2581}sentence\u{FF5C}>", "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\u{FF5C}fim\u{2581}begin\u{FF5C}>", "<PRE>", "\u{2581}<PRE>", "<|code_prefix|>", "<|prefix|>"];
const FIM_SUF_TEXTS: &[&str] = &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\u{FF5C}fim\u{2581}hole\u{FF5C}>", "<SUF>", "\u{2581}<SUF>", "<|code_suffix|>", "<|suffix|>"];
const FIM_MID_TEXTS: &[&str] = &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\u{FF5C}fim\u{2581}end\u{FF5C}>", "<MID>", "\u{2581}<MID>", "<|code_middle|>", "<|middle|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Tokens that end generation wherever they are, by text.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>", "<|endoftext|>",
    "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
    "<|tool_response>", "<\u{FF5C}end\u{2581}of\u{2581}sentence\u{FF5C}>", "[e~[",
];

const SPACE_ESCAPE: &str = "\u{2581}";

fn replace(text: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + text.len() / 2);
    let mut i = 0;
    while i < text.len() {
        if text[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

/// `strtol(text[3..5], 16)`: the byte of a `<0xXX>` token (0 where the digits are not hex, as llama.cpp reads it).
fn byte_of(text: &[u8]) -> u8 {
    let digits = &text[3.min(text.len())..5.min(text.len())];
    let mut value = 0u32;
    for &d in digits {
        match (d as char).to_digit(16) {
            Some(v) => value = value * 16 + v,
            None => break,
        }
    }
    value as u8
}

/// A byte-level BPE token's bytes (its GPT-2 characters mapped back), with llama.cpp's marker for a character that
/// is not one of GPT-2's.
fn decode_byte_level(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for cp in unicode::codepoints(text) {
        match unicode::char_to_byte(cp) {
            Some(b) => out.push(b),
            None => {
                let mut utf8 = Vec::new();
                unicode::push_utf8(&mut utf8, cp);
                out.extend_from_slice(b"[UNK_BYTE_0x");
                for b in &utf8 {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text);
                out.push(b']');
            }
        }
    }
    out
}

/// One piece of a text being partitioned at special tokens.
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab").field("kind", &self.kind).field("pre", &self.pre_name()).field("tokens", &self.tokens.len()).finish_non_exhaustive()
    }
}

impl Vocab {
    pub fn new(meta: &Metadata) -> Result<Vocab, VocabError> {
        let invalid = |m: String| VocabError::Invalid(m);
        let kind = match meta.model.as_str() {
            "llama" => Kind::Spm,
            "gpt2" | "gemma4" => Kind::Bpe,
            "bert" => Kind::Wpm,
            "t5" => Kind::Ugm,
            other => return Err(VocabError::UnsupportedKind(other.to_string())),
        };
        let n = meta.tokens.len();
        if n == 0 {
            return Err(invalid("the vocabulary `tokenizer.ggml.tokens` is empty".into()));
        }
        if n > u32::MAX as usize / 2 {
            return Err(invalid(format!("the vocabulary has {n} tokens")));
        }
        if let Some(scores) = &meta.scores {
            if scores.len() < n {
                return Err(invalid(format!("`tokenizer.ggml.scores` has {} values for {n} tokens", scores.len())));
            }
        }
        if let Some(types) = &meta.token_types {
            if types.len() < n {
                return Err(invalid(format!("`tokenizer.ggml.token_type` has {} values for {n} tokens", types.len())));
            }
        }
        // Defaults by kind, then by pre-tokenizer, then the file's keys.
        let mut specials = match kind {
            Kind::Spm => Specials { bos: Some(1), eos: Some(2), unknown: Some(0), ..Default::default() },
            Kind::Wpm => Specials { bos: Some(101), unknown: Some(100), separator: Some(102), padding: Some(0), mask: Some(103), ..Default::default() },
            Kind::Bpe if meta.model == "gemma4" => Specials::default(),
            Kind::Bpe => Specials { bos: Some(11), eos: Some(11), ..Default::default() },
            Kind::Ugm => Specials { eos: Some(1), unknown: Some(2), padding: Some(0), ..Default::default() },
        };
        let (mut add_bos, mut add_eos, mut add_sep, mut add_space_prefix, mut clean_spaces) = match kind {
            Kind::Spm => (true, false, false, true, false),
            Kind::Wpm => (true, false, true, false, true),
            Kind::Ugm => (false, true, false, false, false),
            Kind::Bpe => (false, false, false, false, true),
        };
        let mut escape_whitespaces = kind != Kind::Bpe;
        let mut pre = None;
        if kind == Kind::Bpe {
            let name = if meta.model == "gemma4" { Some("gemma4") } else { meta.pre.as_deref() };
            let p = pre_tokenizer(name).ok_or_else(|| VocabError::UnsupportedPre(name.unwrap_or_default().to_string()))?;
            clean_spaces = p.clean_spaces;
            add_bos = add_bos || p.add_bos;
            add_sep = add_sep || p.add_sep;
            escape_whitespaces = p.escape_whitespaces;
            if p.no_bos {
                specials.bos = None;
            }
            pre = Some(p);
        }
        if let Some(v) = meta.add_space_prefix {
            add_space_prefix = v;
        }
        let remove_extra_whitespaces = meta.remove_extra_whitespaces.unwrap_or(false);

        let mut tokens = Vec::with_capacity(n);
        let mut ids: HashMap<Box<[u8]>, u32> = HashMap::with_capacity(n);
        let mut max_token_len = 0;
        for (i, text) in meta.tokens.iter().enumerate() {
            let text: Box<[u8]> = if text.is_empty() { format!("[EMPTY_{i}]").into_bytes().into() } else { text.as_bytes().into() };
            max_token_len = max_token_len.max(text.len());
            if ids.insert(text.clone(), i as u32).is_some() {
                return Err(invalid(format!("the vocabulary has the token {:?} twice", String::from_utf8_lossy(&text))));
            }
            let score = meta.scores.as_ref().map_or(0.0, |s| s[i]);
            let attr = match meta.token_types.as_ref().map(|t| t[i]) {
                None | Some(1) => attr::NORMAL,
                Some(2) => attr::UNKNOWN,
                Some(3) => attr::CONTROL,
                Some(4) => attr::USER_DEFINED,
                Some(5) => attr::UNUSED,
                Some(6) => attr::BYTE,
                Some(_) => 0,
            };
            tokens.push(Token { text, score, attr });
        }

        // Special token ids: a default outside the vocabulary is none. A file's own outside it is refused (llama.cpp
        // warns and falls back to its default: a model would run with another BOS than its file says).
        let file = &meta.ids;
        for (name, id) in [("BOS", file.bos), ("EOS", file.eos), ("EOT", file.eot), ("EOM", file.eom), ("unknown", file.unknown), ("separator", file.separator), ("padding", file.padding), ("mask", file.mask)] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(invalid(format!("the {name} token id {id} is outside the vocabulary of {n} tokens")));
            }
        }
        let in_range = |id: Option<u32>| id.filter(|&id| (id as usize) < n);
        let pick = |default: Option<u32>, file: Option<u32>| in_range(file).or(in_range(default));
        specials = Specials {
            bos: pick(specials.bos, file.bos),
            eos: pick(specials.eos, file.eos),
            eot: pick(specials.eot, file.eot),
            eom: pick(specials.eom, file.eom),
            unknown: pick(specials.unknown, file.unknown),
            separator: pick(specials.separator, file.separator),
            padding: pick(specials.padding, file.padding),
            mask: pick(specials.mask, file.mask),
            fim_pre: pick(specials.fim_pre, file.fim_pre),
            fim_suf: pick(specials.fim_suf, file.fim_suf),
            fim_mid: pick(specials.fim_mid, file.fim_mid),
            fim_pad: pick(specials.fim_pad, file.fim_pad),
            fim_rep: pick(specials.fim_rep, file.fim_rep),
            fim_sep: pick(specials.fim_sep, file.fim_sep),
        };
        if let Some(v) = meta.add_bos {
            add_bos = v;
        }
        if let Some(v) = meta.add_eos {
            add_eos = v;
        }
        if let Some(v) = meta.add_sep {
            add_sep = v;
        }
        if pre.is_some_and(|p| p.names.contains(&"gemma4")) {
            add_bos = true;
        }
        let lowercase = meta.lowercase.unwrap_or(true);
        let strip_accents = meta.strip_accents.unwrap_or(lowercase);

        // Special tokens found by their text, as llama.cpp finds them: each becomes a control token.
        // The first text of the list the vocabulary has (llama.cpp takes the first its hash map visits).
        let id_of = |texts: &[&str], ids: &HashMap<Box<[u8]>, u32>| texts.iter().find_map(|t| ids.get(t.as_bytes()).copied());
        for (slot, texts) in [
            (&mut specials.eot, EOT_TEXTS),
            (&mut specials.eom, EOM_TEXTS),
            (&mut specials.fim_pre, FIM_PRE_TEXTS),
            (&mut specials.fim_suf, FIM_SUF_TEXTS),
            (&mut specials.fim_mid, FIM_MID_TEXTS),
            (&mut specials.fim_pad, FIM_PAD_TEXTS),
            (&mut specials.fim_rep, FIM_REP_TEXTS),
            (&mut specials.fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() {
                *slot = id_of(texts, &ids);
                if let Some(id) = *slot {
                    tokens[id as usize].attr |= attr::CONTROL;
                }
            }
        }
        // Control tokens named "unused" are unused.
        for t in &mut tokens {
            if t.attr & attr::CONTROL != 0 && t.text.windows(6).any(|w| w == b"unused") {
                t.attr |= attr::UNUSED;
            }
        }
        let mut end_of_generation: BTreeSet<u32> = [specials.fim_pad, specials.fim_rep, specials.fim_sep].into_iter().flatten().collect();
        for (id, t) in tokens.iter_mut().enumerate() {
            if EOG_TEXTS.iter().any(|e| e.as_bytes() == &*t.text) {
                end_of_generation.insert(id as u32);
                t.attr |= attr::CONTROL;
            }
        }
        // gpt-oss's channel markers are always rendered.
        for t in &mut tokens {
            if [&b"<|channel|>"[..], b"<|message|>", b"<|start|>", b"<|constrain|>"].contains(&&*t.text) {
                t.attr = attr::USER_DEFINED;
            }
        }
        end_of_generation.extend([specials.eos, specials.eot, specials.eom].into_iter().flatten());
        // o200k_harmony and solar-open: `<|end|>` ends a message, not generation, beside `<|return|>` and `<|call|>`;
        // Gemma 4's and PLaMo's `</s>` is a normal token.
        let find = |s: &str, eog: &BTreeSet<u32>, tokens: &[Token]| eog.iter().copied().find(|&id| &*tokens[id as usize].text == s.as_bytes());
        let has = |s: &str, eog: &BTreeSet<u32>, tokens: &[Token]| find(s, eog, tokens).is_some();
        let call = has("<|call|>", &end_of_generation, &tokens) || has("<|calls|>", &end_of_generation, &tokens);
        if (has("<|return|>", &end_of_generation, &tokens) || has("<|flush|>", &end_of_generation, &tokens)) && call {
            if let Some(end) = find("<|end|>", &end_of_generation, &tokens) {
                end_of_generation.remove(&end);
                tokens[end as usize].attr = attr::USER_DEFINED;
            }
        }
        if has("<|tool_response>", &end_of_generation, &tokens) || has("<|plamo:eos|>", &end_of_generation, &tokens) {
            if let Some(s) = find("</s>", &end_of_generation, &tokens) {
                end_of_generation.remove(&s);
                tokens[s as usize].attr = attr::NORMAL;
            }
        }

        let mut special_tokens: Vec<u32> =
            (0..n as u32).filter(|&id| tokens[id as usize].attr & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0).collect();
        special_tokens.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].text.len()));

        // Each token's piece, with llama.cpp's `token_to_piece(special = true)`.
        let mut pieces = Vec::with_capacity(n);
        for t in &tokens {
            let a = t.attr;
            let piece: Vec<u8> = if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
                t.text.to_vec()
            } else if a & attr::NORMAL != 0 {
                if kind != Kind::Bpe || escape_whitespaces {
                    replace(&t.text, SPACE_ESCAPE.as_bytes(), b" ")
                } else {
                    decode_byte_level(&t.text)
                }
            } else if a & attr::BYTE != 0 {
                if kind == Kind::Wpm {
                    return Err(invalid("a WordPiece vocabulary has a byte token".into()));
                }
                if t.text.len() < 3 {
                    return Err(invalid(format!("the byte token {:?} is not `<0xXX>`", String::from_utf8_lossy(&t.text))));
                }
                vec![byte_of(&t.text)]
            } else {
                Vec::new()
            };
            pieces.push(piece.into_boxed_slice());
        }

        // llama.cpp's per-model attributes: Phi-3's special tokens swallow the spaces after them, some encoders' mask
        // token the spaces before it.
        let name = meta.name.as_deref().unwrap_or_default().to_lowercase();
        let pre_name = meta.pre.as_deref().unwrap_or_default();
        let architecture = meta.architecture.as_deref().unwrap_or_default();
        let set = |text: &str, bit: u32, on: bool, tokens: &mut Vec<Token>| -> Result<(), VocabError> {
            let id = *ids.get(text.as_bytes()).ok_or_else(|| VocabError::Invalid(format!("the vocabulary has no `{text}` token")))?;
            let a = &mut tokens[id as usize].attr;
            *a = if on { *a | bit } else { *a & !bit };
            Ok(())
        };
        if ["jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert"].iter().any(|p| pre_name.contains(p))
            || ["nomic-bert-moe", "jina-bert-v3"].iter().any(|a| architecture.contains(a))
        {
            if ids.contains_key(&b"<mask>"[..]) {
                set("<mask>", attr::LSTRIP, true, &mut tokens)?;
            }
        } else if name.contains("phi-3") || name.contains("phi3") {
            for &id in &special_tokens {
                tokens[id as usize].attr |= attr::RSTRIP;
            }
            set("</s>", attr::RSTRIP, true, &mut tokens)?;
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set(t, attr::RSTRIP, false, &mut tokens)?;
            }
        } else if name.contains("modern-bert") && ids.contains_key(&b"[MASK]"[..]) {
            set("[MASK]", attr::LSTRIP, true, &mut tokens)?;
        }

        let token_id = |text: &[u8]| ids.get(text).copied();
        let algorithm = match kind {
            Kind::Spm => Algorithm::Spm,
            Kind::Bpe => {
                let p = pre.expect("BPE has a pre-tokenizer");
                let merges = meta.merges.as_ref().ok_or_else(|| invalid("the BPE vocabulary has no `tokenizer.ggml.merges`".into()))?;
                let splitter = split::Splitter::new(p.expressions, p.byte_encode).map_err(invalid)?;
                Algorithm::Bpe { merges: bpe::Merges::new(merges, token_id), splitter, ignore_merges: p.ignore_merges, whole_newlines: !p.byte_encode }
            }
            Kind::Wpm => {
                if specials.unknown.is_none() {
                    return Err(invalid("the WordPiece vocabulary has no unknown token".into()));
                }
                Algorithm::Wpm { options: wpm::Options { lowercase, strip_accents } }
            }
            Kind::Ugm => {
                if specials.unknown.is_none() {
                    return Err(invalid("the Unigram vocabulary has no unknown token".into()));
                }
                let charsmap = meta.precompiled_charsmap.as_deref().map(ugm::Charsmap::new).transpose().map_err(invalid)?;
                let mut user_defined_prefixes = HashSet::new();
                let mut min_score = f32::MAX;
                for t in &tokens {
                    if t.attr & attr::USER_DEFINED != 0 {
                        for end in 1..=t.text.len() {
                            user_defined_prefixes.insert(t.text[..end].to_vec());
                        }
                    }
                    if t.attr & attr::NORMAL != 0 {
                        min_score = min_score.min(t.score);
                    }
                }
                let options = ugm::Options { add_space_prefix, remove_extra_whitespaces, escape_whitespaces, treat_whitespace_as_suffix: false };
                Algorithm::Ugm { charsmap, user_defined_prefixes, unknown_score: f64::from(min_score - 10.0), options }
            }
        };
        let special_finder = if special_tokens.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(special_tokens.iter().map(|&id| &tokens[id as usize].text)).map_err(|e| invalid(e.to_string()))?)
        };
        Ok(Vocab {
            kind,
            pre,
            tokens,
            ids,
            max_token_len,
            algorithm,
            specials,
            end_of_generation,
            add_bos,
            add_eos,
            add_sep,
            add_space_prefix,
            escape_whitespaces,
            clean_spaces,
            special_tokens,
            special_finder,
            pieces,
        })
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The pre-tokenizer's name as docs/models.md lists it (`None` for other kinds than BPE).
    pub fn pre_name(&self) -> Option<&'static str> {
        self.pre.map(|p| p.names[0])
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn token_id(&self, text: &[u8]) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub fn token_text(&self, id: u32) -> Option<&[u8]> {
        self.tokens.get(id as usize).map(|t| &*t.text)
    }

    pub fn attr(&self, id: u32) -> u32 {
        self.tokens.get(id as usize).map_or(0, |t| t.attr)
    }

    /// Splits `text` at the special tokens in it, longest first, as llama.cpp's `tokenizer_st_partition` does:
    /// control and unknown tokens only when `parse_special`, user-defined ones always; an `lstrip` (`rstrip`) token
    /// takes the whitespace before (after) it.
    fn partition(&self, text: &[u8], parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(0, text.len())];
        let Some(finder) = &self.special_finder else { return fragments };
        // Only the special tokens that occur somewhere in the text can split it.
        let mut present = vec![false; self.special_tokens.len()];
        for m in finder.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
        }
        for (index, &id) in self.special_tokens.iter().enumerate() {
            if !present[index] {
                continue;
            }
            let token = &self.tokens[id as usize];
            if !parse_special && token.attr & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let needle = &*token.text;
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut start, end) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(at) = memchr::memmem::find(&text[start..end], needle).map(|i| start + i) {
                    let mut left_end = at;
                    if token.attr & attr::LSTRIP != 0 {
                        while left_end > start && text[left_end - 1].is_ascii_whitespace_c() {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Fragment::Text(start, left_end));
                    }
                    next.push(Fragment::Token(id));
                    start = at + needle.len();
                    if token.attr & attr::RSTRIP != 0 {
                        while start < end && text[start].is_ascii_whitespace_c() {
                            start += 1;
                        }
                    }
                }
                if start < end {
                    next.push(Fragment::Text(start, end));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// llama.cpp's `llama_tokenize`: `add_special` adds BOS and EOS (or CLS and SEP) as the vocabulary asks;
    /// `parse_special` reads control tokens' texts as those tokens.
    pub fn tokenize(&self, text: &[u8], add_special: bool, parse_special: bool) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        let fragments = self.partition(text, parse_special);
        let token_id = |t: &[u8]| self.token_id(t);
        let bos = |out: &mut Vec<u32>| -> Result<(), TokenizeError> {
            out.push(self.specials.bos.ok_or_else(|| TokenizeError("the vocabulary adds a BOS token but has none".into()))?);
            Ok(())
        };
        let eos = |out: &mut Vec<u32>| -> Result<(), TokenizeError> {
            out.push(self.specials.eos.ok_or_else(|| TokenizeError("the vocabulary adds an EOS token but has none".into()))?);
            Ok(())
        };
        match &self.algorithm {
            Algorithm::Spm => {
                if add_special && self.add_bos {
                    bos(&mut out)?;
                }
                let score = |id: u32| self.tokens[id as usize].score;
                let lookup = spm::Lookup { token_id: &token_id, score: &score };
                let mut previous_special = true;
                for fragment in &fragments {
                    match *fragment {
                        Fragment::Text(start, end) => {
                            let mut piece = Vec::with_capacity(end - start + 1);
                            if self.add_space_prefix && previous_special {
                                piece.push(b' ');
                            }
                            piece.extend_from_slice(&text[start..end]);
                            let escaped = replace(&piece, b" ", SPACE_ESCAPE.as_bytes());
                            spm::encode(&escaped, &lookup, &mut out).map_err(|spm::MissingByte(b)| {
                                TokenizeError(format!("the vocabulary has no token for the byte 0x{b:02X}"))
                            })?;
                            previous_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            previous_special = true;
                        }
                    }
                }
                if add_special && self.add_eos {
                    eos(&mut out)?;
                }
            }
            Algorithm::Bpe { merges, splitter, ignore_merges, whole_newlines } => {
                if add_special && self.add_bos {
                    bos(&mut out)?;
                }
                let lookup = bpe::Lookup { merges, token_id: &token_id, ignore_merges: *ignore_merges, whole_newlines: *whole_newlines, byte_encode: splitter.byte_encode };
                for fragment in &fragments {
                    match *fragment {
                        Fragment::Text(start, end) => {
                            let piece = &text[start..end];
                            let escaped;
                            let piece = if self.escape_whitespaces {
                                escaped = replace(piece, b" ", SPACE_ESCAPE.as_bytes());
                                &escaped[..]
                            } else {
                                piece
                            };
                            for word in splitter.split(piece).map_err(|e| TokenizeError(e.0))? {
                                bpe::encode_word(&word, &lookup, &mut out);
                            }
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special && self.add_eos {
                    eos(&mut out)?;
                }
            }
            Algorithm::Wpm { options } => {
                if add_special {
                    bos(&mut out)?;
                }
                let unknown = self.specials.unknown.expect("checked at load");
                for fragment in &fragments {
                    match *fragment {
                        Fragment::Text(start, end) => wpm::encode(&text[start..end], options, self.max_token_len, &token_id, unknown, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special {
                    out.push(self.specials.separator.ok_or_else(|| TokenizeError("the vocabulary adds a SEP token but has none".into()))?);
                }
            }
            Algorithm::Ugm { charsmap, user_defined_prefixes, unknown_score, options } => {
                if add_special && self.add_bos {
                    bos(&mut out)?;
                }
                let token = |t: &[u8]| {
                    let id = self.token_id(t)?;
                    let tok = &self.tokens[id as usize];
                    if tok.attr & attr::USER_DEFINED != 0 {
                        Some((id, 0.0))
                    } else if tok.attr & (attr::NORMAL | attr::UNUSED) != 0 {
                        Some((id, f64::from(tok.score)))
                    } else {
                        None
                    }
                };
                let model = ugm::Model {
                    charsmap: charsmap.as_ref(),
                    user_defined_prefixes,
                    token: &token,
                    max_token_len: self.max_token_len,
                    unknown: self.specials.unknown.expect("checked at load"),
                    unknown_score: *unknown_score,
                };
                for fragment in &fragments {
                    match *fragment {
                        Fragment::Text(start, end) => ugm::encode(&text[start..end], options, &model, &mut out)
                            .map_err(|ugm::BadCharsmap(m)| TokenizeError(format!("the precompiled character map is malformed: {m}")))?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special && self.add_eos {
                    eos(&mut out)?;
                }
            }
        }
        Ok(out)
    }

    /// A token's text as llama.cpp's `token_to_piece` gives it: control and unknown tokens only when `special`.
    pub fn piece(&self, id: u32, special: bool) -> &[u8] {
        let Some(token) = self.tokens.get(id as usize) else { return &[] };
        if !special && token.attr & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return &[];
        }
        &self.pieces[id as usize]
    }

    /// llama.cpp's `llama_detokenize`: the pieces, the first one's leading space dropped where the tokenizer adds
    /// one (SentencePiece), BOS and EOS left out when `remove_special`, control tokens' texts kept when
    /// `unparse_special`, and spaces before punctuation tidied where the vocabulary asks (`clean_spaces`).
    pub fn detokenize(&self, ids: &[u32], remove_special: bool, unparse_special: bool) -> Vec<u8> {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && !ids.is_empty() && Some(ids[0]) == self.specials.bos {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && ids.last().is_some_and(|&id| Some(id) == self.specials.eos) {
            ids = &ids[..ids.len() - 1];
        }
        let mut text = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let mut piece = self.piece(id, unparse_special);
            if remove_space && piece.first() == Some(&b' ') {
                piece = &piece[1..];
            }
            remove_space = false;
            text.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up(&mut text);
        }
        text
    }
}

trait CSpace {
    /// C's `isspace` in the C locale.
    fn is_ascii_whitespace_c(&self) -> bool;
}

impl CSpace for u8 {
    fn is_ascii_whitespace_c(&self) -> bool {
        matches!(self, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
    }
}

/// llama.cpp's `clean_spaces` passes, in place as it runs them: no space before `?!.,`; none around a lone
/// apostrophe; none before `'s`, `'m`, `'re`, `'ve`.
fn clean_up(text: &mut Vec<u8>) {
    let mut total = text.len();
    let n = total;
    total = usize::from(total > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        text[total] = x;
        total += 1;
    }
    let n = total;
    total = usize::from(total > 0);
    let mut i = 1;
    while i < n {
        let x = text[i];
        if x == b'\'' && i + 1 < n && text[i - 1] == b' ' && text[i + 1] == b' ' {
            total -= 1;
            i += 1;
            text[i] = 0;
        }
        text[total] = x;
        total += 1;
        i += 1;
    }
    let n = total;
    total = usize::from(total > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = text[i + 1];
            if matches!(x1, b's' | b'm') || (!matches!(x1, b't' | b'd') && i + 2 < n && matches!((x1, text[i + 2]), (b'r', b'e') | (b'v', b'e'))) {
                total -= 1;
            }
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);
}

#[cfg(test)]
mod tests;
