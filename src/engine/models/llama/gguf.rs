//! Llama-family decoders from GGUF files: metadata, the tokenizer's tables, and the weights laid out for the
//! device's matmul kernels ([`Layout`]).

use std::fs::File;
use std::ops::Range;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::layers::{vectors, Ffn};
use crate::engine::models::moe::{Expert, Experts, Router};
use super::{Embedding, Layer, Model, ModelConfig, ModelInfo, Weights, MAX_CONTEXT};
use crate::engine::models::gemma::{GemmaConfig, PostNorms};
use crate::engine::models::lanes::Vector;
use crate::engine::kernels::{Matrix, Packed};
use crate::engine::parallel::RankSlice;
use crate::engine::ModelError;
use crate::job::CpuWeights;
use crate::tokenize::VocabMetadata;

pub(crate) fn meta<'a>(content: &'a Content, key: &str) -> Result<&'a Value, ModelError> {
    content.metadata.get(key).ok_or_else(|| ModelError::Metadata(format!("missing `{key}`")))
}

pub(crate) fn meta_usize(content: &Content, key: &str) -> Result<usize, ModelError> {
    let v = meta(content, key)?;
    v.to_u64()
        .map(|v| v as usize)
        .or_else(|_| v.to_u32().map(|v| v as usize))
        .or_else(|_| v.to_i32().map(|v| v.max(0) as usize))
        .map_err(|_| ModelError::Metadata(format!("`{key}` is not an integer")))
}

pub(crate) fn meta_f32(content: &Content, key: &str) -> Option<f32> {
    let v = content.metadata.get(key)?;
    v.to_f32().ok().or_else(|| v.to_f64().ok().map(|v| v as f32))
}

pub(crate) fn meta_u32(content: &Content, key: &str) -> Option<u32> {
    let v = content.metadata.get(key)?;
    v.to_u32().ok().or_else(|| v.to_i32().ok().map(|v| v as u32)).or_else(|| v.to_u64().ok().map(|v| v as u32))
}

fn meta_strings(content: &Content, key: &str) -> Result<Vec<String>, ModelError> {
    match content.metadata.get(key) {
        None => Ok(Vec::new()),
        Some(v) => v
            .to_vec()
            .map_err(|_| ModelError::Metadata(format!("`{key}` is not an array")))?
            .iter()
            .map(|s| s.to_string().cloned().map_err(|_| ModelError::Metadata(format!("`{key}` holds a non-string"))))
            .collect(),
    }
}

pub(crate) fn read_content(path: &Path) -> Result<(File, Content), ModelError> {
    let open = |source| ModelError::Open { path: path.into(), source };
    let mut file = crate::source::model::open_regular(path)?;
    let content = Content::read(&mut file).map_err(|e| ModelError::Format { path: path.into(), message: crate::engine::first_line(&e) })?;
    let length = file.metadata().map_err(open)?.len();
    check_layout(&content, length).map_err(|message| ModelError::Format { path: path.into(), message })?;
    Ok((file, content))
}

/// The tensor data as llama.cpp checks it: every tensor at an aligned offset, a whole number of its type's blocks
/// per row, inside the file, and no two overlapping. candle reads a tensor wherever its offset points, so without
/// this a file whose tensors share bytes, or claim more bytes than the file has, would load (or fail mid-job).
fn check_layout(content: &Content, file_length: u64) -> Result<(), String> {
    let alignment = meta_u32(content, "general.alignment").unwrap_or(32) as u64;
    if !alignment.is_power_of_two() {
        return Err(format!("`general.alignment` is {alignment}, not a power of two"));
    }
    // A file without tensors (llama.cpp's vocabulary-only files) may end before the data section's alignment.
    if content.tensor_infos.is_empty() {
        return Ok(());
    }
    let data = file_length
        .checked_sub(content.tensor_data_offset)
        .ok_or_else(|| format!("the tensor data starts at byte {}, past the end of the file ({file_length} bytes)", content.tensor_data_offset))?;
    let mut spans = Vec::with_capacity(content.tensor_infos.len());
    for (name, info) in &content.tensor_infos {
        let dims = info.shape.dims();
        // No model tensor is empty; and candle reads an empty one through a dangling pointer of the wrong alignment.
        if dims.contains(&0) {
            return Err(format!("tensor `{name}` has no values (shape {dims:?})"));
        }
        let (block, type_size) = (info.ggml_dtype.block_size() as u64, info.ggml_dtype.type_size() as u64);
        if dims.last().is_some_and(|&row| !(row as u64).is_multiple_of(block)) {
            return Err(format!("tensor `{name}` has rows of {} {:?} values, not a whole number of its blocks of {block}", dims[dims.len() - 1], info.ggml_dtype));
        }
        let bytes = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
            .and_then(|elements| (elements / block).checked_mul(type_size))
            .ok_or_else(|| format!("tensor `{name}` has an impossible shape {dims:?}"))?;
        if info.offset % alignment != 0 {
            return Err(format!("tensor `{name}` starts at offset {}, not aligned to {alignment} bytes", info.offset));
        }
        let end = info.offset.checked_add(bytes).filter(|&end| end <= data).ok_or_else(|| {
            format!("tensor `{name}` ({bytes} bytes of {:?} at offset {}) runs past the end of the file's {data} bytes of tensor data", info.ggml_dtype, info.offset)
        })?;
        spans.push((info.offset, end, name));
    }
    spans.sort();
    for pair in spans.windows(2) {
        let ((_, end, first), (start, _, second)) = (pair[0], pair[1]);
        if start < end {
            return Err(format!("tensors `{first}` and `{second}` overlap"));
        }
    }
    Ok(())
}

/// An array of numbers, each converted by `convert`; `None` when the key is absent.
fn meta_numbers<T>(content: &Content, key: &str, convert: impl Fn(&Value) -> Option<T>) -> Result<Option<Vec<T>>, ModelError> {
    let Some(v) = content.metadata.get(key) else { return Ok(None) };
    let values = v.to_vec().map_err(|_| ModelError::Metadata(format!("`{key}` is not an array")))?;
    values.iter().map(|x| convert(x).ok_or_else(|| ModelError::Metadata(format!("`{key}` holds a value of the wrong type")))).collect::<Result<_, _>>().map(Some)
}

fn meta_bool(content: &Content, key: &str) -> Option<bool> {
    content.metadata.get(key).and_then(|v| v.to_bool().ok())
}

/// The tokenizer's keys of a GGUF file (`tokenizer.ggml.*`), as llama.cpp reads them.
pub(super) fn tokenizer_metadata(content: &Content) -> Result<crate::tokenize::gguf::Metadata, ModelError> {
    let string = |key: &str| content.metadata.get(key).and_then(|v| v.to_string().ok().cloned());
    let id = |key: &str| meta_u32(content, key);
    let model = string("tokenizer.ggml.model").ok_or_else(|| ModelError::Metadata("missing `tokenizer.ggml.model`".into()))?;
    if !content.metadata.contains_key("tokenizer.ggml.tokens") {
        return Err(ModelError::Metadata("missing `tokenizer.ggml.tokens`".into()));
    }
    let merges = match content.metadata.contains_key("tokenizer.ggml.merges") {
        true => Some(meta_strings(content, "tokenizer.ggml.merges")?),
        false => None,
    };
    Ok(crate::tokenize::gguf::Metadata {
        model,
        pre: string("tokenizer.ggml.pre"),
        tokens: meta_strings(content, "tokenizer.ggml.tokens")?,
        scores: meta_numbers(content, "tokenizer.ggml.scores", |v| v.to_f32().ok().or_else(|| v.to_i32().ok().map(|i| i as f32)))?,
        token_types: meta_numbers(content, "tokenizer.ggml.token_type", |v| v.to_i32().ok())?,
        merges,
        precompiled_charsmap: meta_numbers(content, "tokenizer.ggml.precompiled_charsmap", |v| v.to_u8().ok().or_else(|| v.to_i8().ok().map(|b| b as u8)))?,
        ids: crate::tokenize::gguf::Specials {
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            eot: id("tokenizer.ggml.eot_token_id"),
            eom: id("tokenizer.ggml.eom_token_id"),
            unknown: id("tokenizer.ggml.unknown_token_id"),
            separator: id("tokenizer.ggml.seperator_token_id"),
            padding: id("tokenizer.ggml.padding_token_id"),
            mask: id("tokenizer.ggml.mask_token_id"),
            fim_pre: id("tokenizer.ggml.fim_pre_token_id").or_else(|| id("tokenizer.ggml.prefix_token_id")),
            fim_suf: id("tokenizer.ggml.fim_suf_token_id").or_else(|| id("tokenizer.ggml.suffix_token_id")),
            fim_mid: id("tokenizer.ggml.fim_mid_token_id").or_else(|| id("tokenizer.ggml.middle_token_id")),
            fim_pad: id("tokenizer.ggml.fim_pad_token_id"),
            fim_rep: id("tokenizer.ggml.fim_rep_token_id"),
            fim_sep: id("tokenizer.ggml.fim_sep_token_id"),
        },
        add_bos: meta_bool(content, "tokenizer.ggml.add_bos_token"),
        add_eos: meta_bool(content, "tokenizer.ggml.add_eos_token"),
        add_sep: meta_bool(content, "tokenizer.ggml.add_sep_token"),
        add_space_prefix: meta_bool(content, "tokenizer.ggml.add_space_prefix"),
        remove_extra_whitespaces: meta_bool(content, "tokenizer.ggml.remove_extra_whitespaces"),
        lowercase: meta_bool(content, "tokenizer.ggml.normalizer.lowercase"),
        strip_accents: meta_bool(content, "tokenizer.ggml.normalizer.strip_accents"),
        name: string("general.name"),
        architecture: string("general.architecture"),
    })
}

/// What a GGUF architecture adds to llama's layers, as llama.cpp reads it: the registry of what nightshift
/// computes from GGUF ([`ARCHITECTURES`], a line per architecture).
#[derive(Clone, Copy, Debug)]
struct Architecture {
    /// llama.cpp's name (`general.architecture`).
    name: &'static str,
    /// Pairs `(i, i + head_dim / 2)` rotate (llama.cpp's NEOX RoPE: q and k rows stored as Hugging Face stores
    /// them) rather than adjacent pairs (llama's, whose rows llama.cpp's converter permutes).
    halves: bool,
    /// q, k and v biases, required (Qwen2; other files' are read where present).
    qkv_bias: bool,
    /// RMSNorms of queries and keys: per head (Qwen3, Gemma 3), or over the whole q and k rows (`qk_norm_rows`).
    qk_norm: bool,
    /// OLMoE's q/k norms, over the whole q and k rows before they are split into heads (weights of `q` and `kv`
    /// values, where per-head norms have `head_dim`).
    qk_norm_rows: bool,
    /// The chosen experts' weights renormalized to sum to 1 (Mixtral, Qwen3-MoE; llama.cpp hard-codes it per
    /// architecture), unless the file says otherwise in `expert_weights_norm`.
    renormalize: bool,
    /// Without `expert_feed_forward_length`, each expert is `feed_forward_length / expert_used_count` wide
    /// (llama.cpp's qwen3moe and qwen2moe); otherwise `feed_forward_length` wide (OLMoE, Mixtral's `llama`).
    experts_split_ffn: bool,
    /// Gemma's version ([`crate::engine::models::gemma`]).
    gemma: Option<u8>,
    /// Phi-3's fused q/k/v and gate/up matrices, and its window over every layer.
    phi3: bool,
    /// A mixture of experts in every layer, required (Qwen3-MoE); a llama file has one where it declares
    /// `llama.expert_count` (Mixtral).
    experts: bool,
    /// RoPE over part of each head (`rope.dimension_count` below the head's width), where llama.cpp computes it
    /// (Phi-4-mini; Gemma's builds take it too); llama.cpp's llama, qwen2 and qwen3 builds assert whole heads, so
    /// nightshift refuses such a file there as well.
    partial_rotary: bool,
    /// Qwen2-MoE's shared expert in every layer beside the routed ones (`ffn_{gate,up,down}_shexp`, gated by
    /// `ffn_gate_inp_shexp`), its routed experts' weights not renormalized (llama.cpp's `build_moe_ffn` call).
    shared_experts: bool,
}

const LLAMA: Architecture =
    Architecture { name: "llama", halves: false, qkv_bias: false, qk_norm: false, qk_norm_rows: false, renormalize: true, experts_split_ffn: false, gemma: None, phi3: false, experts: false, partial_rotary: false, shared_experts: false };

/// The GGUF architectures nightshift computes.
const ARCHITECTURES: &[Architecture] = &[
    LLAMA,
    Architecture { name: "qwen2", halves: true, qkv_bias: true, ..LLAMA },
    Architecture { name: "qwen3", halves: true, qk_norm: true, ..LLAMA },
    Architecture { name: "gemma2", halves: true, gemma: Some(2), partial_rotary: true, ..LLAMA },
    Architecture { name: "gemma3", halves: true, qk_norm: true, gemma: Some(3), partial_rotary: true, ..LLAMA },
    Architecture { name: "phi3", halves: true, phi3: true, partial_rotary: true, ..LLAMA },
    Architecture { name: "qwen3moe", halves: true, qk_norm: true, experts: true, experts_split_ffn: true, ..LLAMA },
    Architecture { name: "qwen2moe", halves: true, qkv_bias: true, experts: true, experts_split_ffn: true, shared_experts: true, renormalize: false, ..LLAMA },
    Architecture { name: "olmoe", halves: true, qk_norm: true, qk_norm_rows: true, experts: true, renormalize: false, ..LLAMA },
];

impl Architecture {
    /// A checked model's architecture (`info_of` refuses the others).
    fn of(name: &str) -> Architecture {
        ARCHITECTURES.iter().copied().find(|a| a.name == name).unwrap_or(LLAMA)
    }
}

fn info_of(content: &Content) -> Result<ModelInfo, ModelError> {
    let architecture = meta(content, "general.architecture")?
        .to_string()
        .map_err(|_| ModelError::Metadata("`general.architecture` is not a string".into()))?
        .clone();
    if !ARCHITECTURES.iter().any(|a| a.name == architecture) {
        return Err(ModelError::Architecture { name: architecture, supported: "llama (Llama 2 and 3, Mistral, Mixtral, SmolLM, ...), qwen2, qwen3, qwen2moe, qwen3moe, olmoe, gemma2, gemma3 and phi3 in GGUF files; t5 in seq2seq jobs" });
    }
    let a = |k: &str| format!("{architecture}.{k}");
    let hidden_size = meta_usize(content, &a("embedding_length"))?;
    let heads = meta_usize(content, &a("attention.head_count"))?;
    let kv_heads = meta_usize(content, &a("attention.head_count_kv")).unwrap_or(heads);
    // Heads may be wider or narrower than hidden / heads (Qwen3, Mistral Nemo): `key_length` says so.
    let head_dim = match content.metadata.contains_key(&a("attention.key_length")) {
        true => meta_usize(content, &a("attention.key_length"))?,
        false if heads > 0 && hidden_size % heads == 0 => hidden_size / heads,
        false => 0,
    };
    if heads == 0 || kv_heads == 0 || head_dim == 0 || heads % kv_heads != 0 || heads > 4096 || head_dim > 4096 {
        return Err(ModelError::Metadata(format!(
            "inconsistent attention shape: hidden size {hidden_size}, {heads} heads of {head_dim}, {kv_heads} kv heads"
        )));
    }
    if head_dim % 2 != 0 {
        return Err(ModelError::Metadata(format!("head size {head_dim} is odd")));
    }
    let value_length = meta_usize(content, &a("attention.value_length")).unwrap_or(head_dim);
    if value_length != head_dim {
        return Err(ModelError::Metadata(format!("heads of {head_dim} with values of {value_length}: nightshift computes keys and values of one width")));
    }
    // RoPE over the first `rope.dimension_count` values of each head (Phi-4-mini's 96 of 128), the rest unrotated.
    let rotary_dim = meta_usize(content, &a("rope.dimension_count")).unwrap_or(head_dim);
    if rotary_dim < 2 || rotary_dim > head_dim || !rotary_dim.is_multiple_of(2) {
        return Err(ModelError::Metadata(format!("`{}` is {rotary_dim}: RoPE rotates an even number of a head's {head_dim} values, at least 2", a("rope.dimension_count"))));
    }
    if rotary_dim != head_dim && !Architecture::of(&architecture).partial_rotary {
        return Err(ModelError::Metadata(format!("`{}` is {rotary_dim} of a head's {head_dim} values: {architecture} rotates whole heads (as llama.cpp requires)", a("rope.dimension_count"))));
    }
    // RoPE scaling as llama.cpp reads it: linear (positions divided by the factor), or per-frequency factors in a
    // `rope_freqs` tensor (Llama 3.1 and later, read at load). Others are refused rather than computed without.
    let mut rope_freq_factors = None;
    match content.metadata.get(&a("rope.scaling.type")).and_then(|v| v.to_string().ok()).map(String::as_str) {
        None | Some("none") => {}
        Some("linear") => {
            let factor = meta_f32(content, &a("rope.scaling.factor")).unwrap_or(1.0);
            if !(factor.is_finite() && factor > 0.0) {
                return Err(ModelError::Metadata(format!("`{}` is {factor}", a("rope.scaling.factor"))));
            }
            rope_freq_factors = Some(vec![factor; rotary_dim / 2]);
        }
        Some(other) => {
            return Err(ModelError::Metadata(format!("RoPE scaling `{other}` is not supported (supported: none, linear, and `rope_freqs` factors)")));
        }
    }
    let tokenizer = tokenizer_metadata(content)?;
    let chat_template = content.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok().cloned());
    let vocab = VocabMetadata::of_gguf(crate::tokenize::gguf::Vocab::new(&tokenizer)?, &tokenizer, chat_template);
    // Out-of-range values would compute NaN or garbage for every row, not fail: refused, naming the key.
    let rms_eps = meta_f32(content, &a("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5);
    if !(rms_eps.is_finite() && rms_eps > 0.0 && rms_eps < 1.0) {
        return Err(ModelError::Metadata(format!("`{}` is {rms_eps}: an RMSNorm epsilon is above 0 and below 1", a("attention.layer_norm_rms_epsilon"))));
    }
    let rope_base = meta_f32(content, &a("rope.freq_base")).unwrap_or(10_000.0);
    if !(rope_base.is_finite() && rope_base > 1.0) {
        return Err(ModelError::Metadata(format!("`{}` is {rope_base}: a RoPE base is finite and above 1", a("rope.freq_base"))));
    }
    let mut context_length = meta_usize(content, &a("context_length"))?;
    let layers = meta_usize(content, &a("block_count"))?;
    let arch = Architecture::of(&architecture);
    let gemma = match arch.gemma {
        Some(version) => {
            let number = |key: &str| {
                let v = content.metadata.get(&a(key))?;
                v.to_f64().ok().or_else(|| v.to_f32().ok().map(f64::from)).or_else(|| meta_u32(content, &a(key)).map(f64::from))
            };
            let key = a("attention.sliding_window_pattern");
            // An array of booleans (one per layer) where the file has one; a period otherwise.
            let pattern = match content.metadata.get(&key).map(Value::to_vec) {
                Some(Ok(values)) => Some(values.iter().map(|v| v.to_bool().map_err(|_| ModelError::Metadata(format!("`{key}` holds a non-boolean")))).collect::<Result<Vec<bool>, _>>()?),
                _ => None,
            };
            Some(GemmaConfig::of_gguf(version, layers, (hidden_size, heads, head_dim), rope_base, number, pattern)?)
        }
        None => None,
    };
    let mut long_rope = None;
    let (gemma, mut sliding) = match gemma {
        Some((gemma, sliding)) => (Some(gemma), sliding),
        None => (None, None),
    };
    // Phi-3's window covers every layer and slides in the attention backends, as Hugging Face computes it (llama.cpp
    // switches Phi's sliding window off, attending over the whole context).
    if arch.phi3 {
        if let Some(window) = meta_u32(content, &a("attention.sliding_window")).map(|w| w as usize).filter(|&w| w > 0 && w < context_length) {
            sliding = Some(crate::engine::models::Sliding::every_layer(window, layers, rope_base));
        }
        // LongRoPE (Phi-3's 128k models, Phi-3.5): the long or short factors (read at load) by the context served
        // against the pre-trained one, and the attention factor.
        if content.tensor_infos.contains_key("rope_factors_long.weight") {
            let original = meta_usize(content, &a("rope.scaling.original_context_length")).unwrap_or(context_length);
            let attn_factor = meta_f32(content, &a("rope.scaling.attn_factor")).unwrap_or(1.0);
            if original == 0 || !(attn_factor.is_finite() && attn_factor > 0.0) {
                return Err(ModelError::Metadata(format!("LongRoPE's pre-trained context {original} or attention factor {attn_factor} is out of range")));
            }
            long_rope = Some(super::LongRope { long: context_length > original, original_context: original, attn_factor });
        }
    }
    // Sliding-window attention of every layer (llama's): the context is capped at the window, where full attention
    // computes the same function (as for Hugging Face directories). Gemma's layers slide in the attention backends.
    let llama_window = meta_u32(content, &a("attention.sliding_window")).filter(|_| gemma.is_none() && !arch.phi3);
    if let Some(window) = llama_window.map(|w| w as usize).filter(|&w| w < context_length) {
        if window == 0 {
            return Err(ModelError::Metadata(format!("`{}` is 0", a("attention.sliding_window"))));
        }
        tracing::info!(window, declared = context_length, "context capped at the sliding window");
        context_length = window;
    }
    // A mixture of experts (Mixtral: `llama.expert_count`; Qwen3-MoE), with llama.cpp's softmax gating. Both
    // renormalize the chosen experts' weights (llama.cpp hard-codes it for these two); `expert_weights_norm`, which
    // llama.cpp reads for other architectures, is honoured where a file has it. Each expert's network is
    // `expert_feed_forward_length` wide (Qwen3-MoE) or `feed_forward_length` (Mixtral)
    let moe = match meta_usize(content, &a("expert_count")).ok().filter(|&n| n > 0) {
        None if arch.experts => return Err(ModelError::Metadata(format!("missing `{}`", a("expert_count")))),
        None => None,
        Some(experts) => {
            let used = meta_usize(content, &a("expert_used_count"))?;
            let normalize = meta_bool(content, &a("expert_weights_norm")).unwrap_or(arch.renormalize);
            let moe = crate::engine::models::moe::MoeConfig::new(experts, used, normalize)?;
            // Qwen2-MoE's shared expert, `expert_shared_feed_forward_length` wide (llama.cpp's default: the
            // dense width).
            match arch.shared_experts {
                true => Some(moe.with_shared(meta_usize(content, &a("expert_shared_feed_forward_length")).or_else(|_| meta_usize(content, &a("feed_forward_length")))?)?),
                false => Some(moe),
            }
        }
    };
    // (Qwen3-MoE without `expert_feed_forward_length`: `feed_forward_length / expert_used_count`, as llama.cpp.)
    let ffn_size = match (&moe, content.metadata.contains_key(&a("expert_feed_forward_length"))) {
        (Some(_), true) => meta_usize(content, &a("expert_feed_forward_length"))?,
        (Some(m), false) if arch.experts_split_ffn => meta_usize(content, &a("feed_forward_length"))? / m.used,
        _ => meta_usize(content, &a("feed_forward_length"))?,
    };
    let config = ModelConfig {
        name: content.metadata.get("general.name").and_then(|v| v.to_string().ok().cloned()),
        context_length,
        layers,
        ffn_size,
        rms_eps,
        rope_base,
        rope_scaling: None,
        rope_freq_factors,
        vocab_size: vocab.tokens.len(),
        hidden_size,
        heads,
        kv_heads,
        head_dim,
        rotary_dim,
        architecture,
        gemma,
        sliding,
        moe,
        long_rope,
    };
    // Bounds that keep a malformed file from asking for absurd allocations (the RoPE table is sized by context).
    if config.context_length == 0 || config.context_length > MAX_CONTEXT || config.layers == 0 || config.layers > 1024 {
        return Err(ModelError::Metadata(format!(
            "context length {} or layer count {} is out of range",
            config.context_length, config.layers
        )));
    }
    super::check_vocab(&vocab, config.vocab_size)?;
    let mut counts = std::collections::BTreeMap::new();
    let mut weights = super::StoredWeights::default();
    for (name, info) in &content.tensor_infos {
        *counts.entry(format!("{:?}", info.ggml_dtype).to_lowercase()).or_insert(0) += 1;
        // Whole blocks (checked when the file was read); saturating, as a count for messages only.
        let elements = info.shape.dims().iter().fold(1u64, |n, &d| n.saturating_mul(d as u64));
        weights.add(name, (elements / info.ggml_dtype.block_size() as u64).saturating_mul(info.ggml_dtype.type_size() as u64));
    }
    Ok(ModelInfo { config, vocab, tensor_types: counts.into_iter().collect(), weights })
}

/// A q or k projection `[heads x head_dim, k]` with each head's rows reordered from pairs `(i, i + rotary_dim / 2)`
/// to adjacent pairs ([`super::hf::rotary_row_order`], as [`super::hf::interleave_halves`] does), on the stored
/// (quantized) rows themselves: a row's blocks are its own, so the permuted matrix is the same weights, bit for bit.
fn interleave_rows(t: QTensor, head_dim: usize, rotary_dim: usize, device: &Device) -> candle_core::Result<QTensor> {
    let dims = t.shape().dims().to_vec();
    let rows = dims[0];
    let data = t.data()?;
    if head_dim == 0 || !rows.is_multiple_of(head_dim) || !data.len().is_multiple_of(rows) {
        candle_core::bail!("{rows} rows are not whole heads of {head_dim}");
    }
    let row_bytes = data.len() / rows;
    let order = super::hf::rotary_row_order(head_dim, rotary_dim);
    let mut out = Vec::with_capacity(data.len());
    for head in 0..rows / head_dim {
        for &r in &order {
            let row = head * head_dim + r;
            out.extend_from_slice(&data[row * row_bytes..(row + 1) * row_bytes]);
        }
    }
    candle_core::quantized::ggml_file::qtensor_from_ggml(t.dtype(), &out, dims, device)
}

/// Which of a layer's projections a file stores fused (Phi-3): q, k and v as one `attn_qkv` (rows q, then k, then v),
/// gate and up as one `ffn_up` of twice the feed-forward width (gate's rows first, as Hugging Face's
/// `gate_up_proj` chunks them and llama.cpp's SwiGLU splits them).
#[derive(Clone, Copy, Debug)]
struct Fused {
    qkv: bool,
    gate_up: bool,
}

impl Fused {
    fn of(content: &Content, config: &ModelConfig) -> Fused {
        let phi3 = Architecture::of(&config.architecture).phi3;
        Fused { qkv: phi3 && content.tensor_infos.contains_key("blk.0.attn_qkv.weight"), gate_up: phi3 }
    }
}

/// A matrix's rows in consecutive parts of `parts[i]` rows each (they sum to its rows).
fn split_rows(t: QTensor, parts: &[usize], device: &Device) -> candle_core::Result<Vec<QTensor>> {
    let dims = t.shape().dims().to_vec();
    let rows = dims[0];
    if parts.iter().sum::<usize>() != rows {
        candle_core::bail!("{rows} rows are not parts of {parts:?}");
    }
    let data = t.data()?;
    let row_bytes = data.len() / rows;
    let mut at = 0;
    parts
        .iter()
        .map(|&n| {
            let bytes = &data[at * row_bytes..(at + n) * row_bytes];
            at += n;
            candle_core::quantized::ggml_file::qtensor_from_ggml(t.dtype(), bytes, vec![n, dims[1]], device)
        })
        .collect()
}

/// A stack of experts' matrices `[experts, rows, columns]`, one matrix per expert (each expert's rows are its own
/// bytes: the parts are the stored weights, bit for bit).
fn split_experts(t: QTensor, device: &Device) -> candle_core::Result<Vec<QTensor>> {
    let dims = t.shape().dims().to_vec();
    let [experts, rows, columns] = dims[..] else { candle_core::bail!("experts' matrices of shape {dims:?}") };
    let data = t.data()?;
    let bytes = data.len() / experts;
    (0..experts).map(|e| candle_core::quantized::ggml_file::qtensor_from_ggml(t.dtype(), &data[e * bytes..(e + 1) * bytes], vec![rows, columns], device)).collect()
}

/// A host tensor moved to `device` (a copy of its bytes; the same tensor on the CPU).
fn to_device(t: QTensor, device: &Device) -> candle_core::Result<QTensor> {
    match device.is_cpu() {
        true => Ok(t),
        false => candle_core::quantized::ggml_file::qtensor_from_ggml(t.dtype(), &t.data()?, t.shape().dims().to_vec(), device),
    }
}

/// How weights are laid out for the matmul kernels of this device.
///
/// As stored (the default), a CPU computes the file's matrices on nightshift's kernels ([`crate::engine::kernels`]).
/// The requantized layouts (`runtime.cpu_weights = "fast"` or `"q8_0"`) are for candle's fast kernels (repacked
/// tiles on AVX-512 VNNI), which take Q8_0, Q6_K and Q4_K weights whose inner dimension K is a multiple of 256 and
/// whose row count is a multiple of 16. SmolLM2's hidden size is 576, so those layouts are padded: the hidden
/// state, the attention output and the feed-forward state are zero-padded to a multiple of 256 from the embedding
/// on, every matrix gets zero columns (and zero rows where its output feeds the hidden state), and the weights are
/// requantized. Padded columns stay exactly zero through the residual stream: zero rows produce zeros, SiLU(0) x 0
/// is 0, and the RMSNorm weights' padding is zero. The norms divide by the padded width, which the weights and
/// epsilon are rescaled for (`padded_norm`), so the model computes the same function, at lower precision, with a
/// third more multiply-adds at K = 576 (`../shared/reference/cpu-matmul.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Weights as stored in the file, unpadded.
    AsStored,
    /// Unpadded, with Q4_0 and Q4_1 matrices requantized to Q8_0: candle's CPU kernels for those two are scalar,
    /// and Q8_0's generic ones twice as fast. For models too small for padding to pay (it would more than add a
    /// third to a width).
    Q8,
    /// Padded to multiples of 256; the layers' matrices requantized to the first type, the output projection to
    /// the second.
    Padded(candle_core::quantized::GgmlDType, candle_core::quantized::GgmlDType),
    /// A Hugging Face checkpoint's 16-bit matrices (bf16 or f16, this one) as stored, on the CPU's kernels, which
    /// widen each weight exactly and take the activations in f32 (`runtime.cpu_weights = "as-stored"` on the CPU;
    /// `"f32"` widens them at load for candle's f32 products instead, [`Layout::AsStored`]).
    Stored16(candle_core::quantized::GgmlDType),
}

impl Layout {
    /// The layout `runtime.cpu_weights` asks for, for a model on a device. As stored on any device but the CPU.
    /// On the CPU, `fast`: layers in padded Q4_K and the output projection in padded Q6_K (Q4_K would add 8.7 %
    /// error to it; candle's Q8_0 has no fast kernel here), unless padding would add more than a third to a width
    /// (then [`Layout::Q8`]); `q8_0`: every matrix in padded Q8_0 (or [`Layout::Q8`] likewise).
    pub fn choose(device: &Device, config: &ModelConfig, weights: CpuWeights) -> Layout {
        use candle_core::quantized::GgmlDType;
        let (layers, output) = match weights {
            _ if !device.is_cpu() => return Layout::AsStored,
            CpuWeights::AsStored | CpuWeights::F32 => return Layout::AsStored,
            CpuWeights::Fast => (GgmlDType::Q4K, GgmlDType::Q6K),
            CpuWeights::Q8_0 => (GgmlDType::Q8_0, GgmlDType::Q8_0),
        };
        let padded = Layout::Padded(layers, output);
        let worth = |w: usize| padded.pad(w) * 3 <= w * 4;
        if worth(config.hidden_size) && worth(config.heads * config.head_dim) && worth(config.ffn_size) {
            padded
        } else {
            Layout::Q8
        }
    }

    /// What the layout computes with, as the load log and the metrics' `weights_layout` column name it.
    pub fn name(self) -> &'static str {
        use candle_core::quantized::GgmlDType;
        match self {
            Layout::AsStored => "as-stored",
            Layout::Q8 => "q4_0/q4_1 requantized to q8_0",
            Layout::Padded(GgmlDType::Q4K, GgmlDType::Q6K) => "requantized to q4_k, output q6_k, padded",
            Layout::Padded(GgmlDType::Q8_0, GgmlDType::Q8_0) => "requantized to q8_0, padded",
            Layout::Padded(..) => "requantized, padded",
            Layout::Stored16(GgmlDType::F16) => "f16 as stored, on the CPU kernels",
            Layout::Stored16(_) => "bf16 as stored, on the CPU kernels",
        }
    }

    /// Whether the matrices are on nightshift's CPU kernels (on the CPU): as stored, GGUF or 16-bit.
    pub fn on_kernels(self) -> bool {
        matches!(self, Layout::AsStored | Layout::Stored16(_))
    }

    fn pad(self, width: usize) -> usize {
        match self {
            Layout::AsStored | Layout::Q8 | Layout::Stored16(_) => width,
            Layout::Padded(..) => width.div_ceil(256) * 256,
        }
    }

    /// The same layout, with the output projection's type for the layers too.
    fn for_output(self) -> Layout {
        match self {
            Layout::Padded(_, output) => Layout::Padded(output, output),
            other => other,
        }
    }
}

/// A laid-out matrix for the model: the weights as stored go to the CPU's kernels where they take the type
/// ([`Matrix::new`]); requantized layouts are made for candle's kernels and stay with them.
fn matrix(t: QTensor, layout: Layout, device: &Device) -> candle_core::Result<Matrix> {
    match layout {
        Layout::AsStored | Layout::Stored16(_) => Matrix::new(t, device),
        _ => QMatMul::from_qtensor(t).map(Matrix::Candle),
    }
}

/// A weight matrix `[n, k]` laid out as `[n_pad, k_pad]`, zero-filled, requantized.
fn lay_out(t: QTensor, n_pad: usize, k_pad: usize, layout: Layout, device: &Device) -> candle_core::Result<QTensor> {
    use candle_core::quantized::GgmlDType;
    let dtype = match layout {
        Layout::AsStored | Layout::Stored16(_) => return Ok(t),
        Layout::Q8 if matches!(t.dtype(), GgmlDType::Q4_0 | GgmlDType::Q4_1) && t.shape().dims().last().is_some_and(|k| k % 32 == 0) => {
            return QTensor::quantize(&t.dequantize(device)?, GgmlDType::Q8_0);
        }
        Layout::Q8 => return Ok(t),
        Layout::Padded(dtype, _) => dtype,
    };
    let (n, k) = t.shape().dims2()?;
    let w = t.dequantize(device)?;
    let w = if k_pad > k { w.pad_with_zeros(1, 0, k_pad - k)? } else { w };
    let w = if n_pad > n { w.pad_with_zeros(0, 0, n_pad - n)? } else { w };
    quantize_rows(&w, dtype, device)
}

/// `QTensor::quantize`, in parallel over chunks of rows (quantization blocks run along rows, so the chunks'
/// bytes concatenate into the whole matrix's). K-quants search each block's scales, which makes requantizing
/// the output projection alone take a second on one core.
fn quantize_rows(w: &Tensor, dtype: candle_core::quantized::GgmlDType, device: &Device) -> candle_core::Result<QTensor> {
    const ROWS: usize = 1024;
    let (n, k) = w.dims2()?;
    if n <= ROWS {
        return QTensor::quantize(w, dtype);
    }
    // Each chunk gets its own storage: `QTensor::quantize` reads a tensor's storage from its start, so a narrowed
    // view would quantize the wrong rows.
    let values = w.flatten_all()?.to_vec1::<f32>()?;
    let chunks: Vec<Vec<u8>> = (0..n.div_ceil(ROWS))
        .into_par_iter()
        .map(|c| {
            let rows = ROWS.min(n - c * ROWS);
            let chunk = Tensor::from_slice(&values[c * ROWS * k..(c * ROWS + rows) * k], (rows, k), &Device::Cpu)?;
            QTensor::quantize(&chunk, dtype).and_then(|q| q.data().map(|d| d.into_owned()))
        })
        .collect::<candle_core::Result<_>>()?;
    candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &chunks.concat(), vec![n, k], device)
}

/// An RMSNorm weight `[d]` for a hidden state padded to `width`: zeros in the padding, and scaled so that the
/// mean over the padded width (smaller by d / width) gives the model's result with epsilon scaled the same way.
fn padded_norm(w: Tensor, width: usize) -> candle_core::Result<Tensor> {
    let d = w.dims1()?;
    if width == d {
        return Ok(w);
    }
    (w * (d as f64 / width as f64).sqrt())?.pad_with_zeros(0, 0, width - d)
}

/// Reads a GGUF file's tokenizer keys alone, whatever its architecture (llama.cpp's vocabulary-only files too).
pub fn read_tokenizer(path: &Path) -> Result<(crate::tokenize::gguf::Metadata, Option<String>), ModelError> {
    let (_, content) = read_content(path)?;
    let chat_template = content.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok().cloned());
    Ok((tokenizer_metadata(&content)?, chat_template))
}

/// A GGUF file's tokenizer, ready to run, whatever its architecture.
pub fn vocabulary(path: &Path) -> Result<VocabMetadata, ModelError> {
    let (tokenizer, chat_template) = read_tokenizer(path)?;
    Ok(VocabMetadata::of_gguf(crate::tokenize::gguf::Vocab::new(&tokenizer)?, &tokenizer, chat_template))
}

/// Reads a GGUF file's metadata (architecture, shapes, tokenizer) and checks its tensors' names and shapes
/// against it ([`check_tensors`], as [`load`] does), without loading its weights.
pub(super) fn inspect(path: &Path) -> Result<ModelInfo, ModelError> {
    let (_, content) = read_content(path)?;
    let info = info_of(&content)?;
    check_tensors(&content, &info.config)?;
    Ok(info)
}

/// Every tensor the model's configuration needs, with the shape it must have (candle's order: rows first), and
/// whether it must be there: `validate` and `run` refuse the same files through this one list (exit 4).
fn expected_tensors(content: &Content, config: &ModelConfig) -> Vec<(String, Vec<usize>, bool)> {
    let (d, hd, v) = (config.hidden_size, config.head_dim, config.vocab_size);
    let (q, kv, f) = (config.heads * hd, config.kv_heads * hd, config.ffn_size);
    let has = |name: &str| content.tensor_infos.contains_key(name);
    let arch = Architecture::of(&config.architecture);
    let mut out = vec![("token_embd.weight".to_string(), vec![v, d], true), ("output_norm.weight".into(), vec![d], true), ("output.weight".into(), vec![v, d], false)];
    // LongRoPE's two factor sets (Phi-3's 128k models).
    let long_rope = config.long_rope.is_some();
    out.push(("rope_factors_long.weight".into(), vec![config.rotary_dim / 2], long_rope));
    out.push(("rope_factors_short.weight".into(), vec![config.rotary_dim / 2], long_rope));
    let fused = Fused::of(content, config);
    for i in 0..config.layers {
        let mut need = |suffix: &str, dims: Vec<usize>, required: bool| out.push((format!("blk.{i}.{suffix}"), dims, required));
        // In the layer's order, so the first mismatch named is the first in the layer.
        need("attn_norm.weight", vec![d], true);
        need("ffn_norm.weight", vec![d], true);
        match fused.qkv {
            true => need("attn_qkv.weight", vec![q + 2 * kv, d], true),
            false => {
                need("attn_q.weight", vec![q, d], true);
                need("attn_k.weight", vec![kv, d], true);
                need("attn_v.weight", vec![kv, d], true);
            }
        }
        need("attn_output.weight", vec![d, q], true);
        // Experts' matrices stacked, one `[f, d]` (or `[d, f]`) per expert; the router one row per expert.
        match (&config.moe, fused.gate_up) {
            (Some(moe), _) => {
                let e = moe.experts;
                need("ffn_gate_inp.weight", vec![e, d], true);
                need("ffn_gate_exps.weight", vec![e, f, d], true);
                need("ffn_up_exps.weight", vec![e, f, d], true);
                need("ffn_down_exps.weight", vec![e, d, f], true);
                if let Some(s) = moe.shared {
                    need("ffn_gate_inp_shexp.weight", vec![d], true);
                    need("ffn_gate_shexp.weight", vec![s, d], true);
                    need("ffn_up_shexp.weight", vec![s, d], true);
                    need("ffn_down_shexp.weight", vec![d, s], true);
                }
            }
            (None, true) => need("ffn_up.weight", vec![2 * f, d], true),
            (None, false) => {
                need("ffn_gate.weight", vec![f, d], true);
                need("ffn_up.weight", vec![f, d], true);
            }
        }
        if config.moe.is_none() {
            need("ffn_down.weight", vec![d, f], true);
        }
        // Qwen2's q, k and v biases are required (as llama.cpp requires them); a llama file's are read where present.
        let biases = arch.qkv_bias || has(&format!("blk.{i}.attn_q.bias"));
        for (suffix, dims) in [("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)] {
            need(suffix, vec![dims], biases);
        }
        need("attn_output.bias", vec![d], false);
        let qk_norm = arch.qk_norm;
        let (qn, kn) = if arch.qk_norm_rows { (q, kv) } else { (hd, hd) };
        need("attn_q_norm.weight", vec![qn], qk_norm);
        need("attn_k_norm.weight", vec![kn], qk_norm);
        let gemma = config.gemma.is_some();
        need("post_attention_norm.weight", vec![d], gemma);
        need("post_ffw_norm.weight", vec![d], gemma);
    }
    out
}

/// The file's tensors against [`expected_tensors`]: a required one missing, or any of them of another shape than
/// the metadata implies, is a malformed file (exit 4), found before any weight is read.
fn check_tensors(content: &Content, config: &ModelConfig) -> Result<(), ModelError> {
    for (name, dims, required) in expected_tensors(content, config) {
        match content.tensor_infos.get(&name) {
            None if required => return Err(ModelError::Metadata(format!("the file has no tensor `{name}`, which its metadata needs"))),
            None => {}
            Some(info) if info.shape.dims() != dims.as_slice() => {
                return Err(ModelError::Metadata(format!("tensor `{name}` has shape {:?}, but the metadata implies {dims:?}", info.shape.dims())));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Loads a GGUF llama-family model in the weight layout `layout` picks for its configuration.
/// Loads the model, or a tensor-parallel rank's slice of it (`slice`), with another rank's embedding table where
/// one is given (`shared`: then neither read nor held twice).
pub(super) fn load(path: &Path, device: &Device, layout: impl FnOnce(&ModelConfig) -> Layout, slice: Option<&RankSlice>, shared: Option<&Embedding>) -> Result<(Model, ModelInfo), ModelError> {
    let (mut file, content) = read_content(path)?;
    let info = info_of(&content)?;
    check_tensors(&content, &info.config)?;
    let layout = layout(&info.config);
    let whole = RankSlice::whole(info.config.heads, info.config.kv_heads);
    let slice = slice.unwrap_or(&whole);
    let tp = slice.ranks > 1;
    if Architecture::of(&info.config.architecture).qk_norm_rows && (tp || matches!(layout, Layout::Padded(..))) {
        return Err(ModelError::Metadata(format!(
            "{}'s q/k norms take whole q and k rows: neither split over ranks nor padded (runtime.tensor_parallel = 1, runtime.cpu_weights = \"as-stored\")",
            info.config.architecture
        )));
    }
    if tp && matches!(layout, Layout::Padded(..)) {
        return Err(ModelError::Metadata(format!("tensor parallelism splits the weights as stored: runtime.cpu_weights = \"{}\" pads and requantizes them (use \"as-stored\")", layout.name())));
    }
    let mut config = info.config.clone();
    let fmt = |e: candle_core::Error| ModelError::Format { path: path.into(), message: crate::engine::first_line(&e) };
    let file = std::cell::RefCell::new(&mut file);
    let read = |name: &str, on: &Device| -> Result<QTensor, ModelError> { content.tensor(&mut **file.borrow_mut(), name, on).map_err(fmt) };
    // Per-frequency RoPE factors (Llama 3.1's `rope_freqs`), with a linear scaling's if both are given.
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        let factors = read("rope_freqs.weight", &Device::Cpu)?.dequantize(&Device::Cpu).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).map_err(fmt)?;
        if factors.len() != config.rotary_dim / 2 || factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(ModelError::Metadata(format!("`rope_freqs.weight` has {} factors for {} rotated values, or one not positive", factors.len(), config.rotary_dim)));
        }
        let linear = config.rope_freq_factors.take().unwrap_or_else(|| vec![1.0; factors.len()]);
        config.rope_freq_factors = Some(factors.iter().zip(linear).map(|(f, l)| f * l).collect());
    }
    // LongRoPE's factor set, the long or the short, as the frequencies' divisors.
    if let Some(l) = &config.long_rope {
        let name = if l.long { "rope_factors_long.weight" } else { "rope_factors_short.weight" };
        let factors = read(name, &Device::Cpu)?.dequantize(&Device::Cpu).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).map_err(fmt)?;
        if factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(ModelError::Metadata(format!("`{name}` holds a factor that is not positive")));
        }
        config.rope_freq_factors = Some(factors);
    }
    let arch = Architecture::of(&config.architecture);
    let halves = arch.halves;
    // A tensor-parallel rank's tensors are read on the host, sliced there, then moved.
    let on = if tp { Device::Cpu } else { device.clone() };
    let qtensor = |name: &str| read(name, &on);
    // Every tensor's presence and shape were checked by `check_tensors` above.
    let (d, hd) = (config.hidden_size, config.head_dim);
    let (width, attn_width, ffn_width) = (layout.pad(d), layout.pad(slice.heads.len() * hd), layout.pad(config.ffn_size));
    // This rank's part of a matrix (all of it on one rank): q rows by query heads, k and v rows by kv heads, the
    // output projection's columns by query heads; gate and up rows and down columns by feed-forward columns (of an
    // expert's width where the layer has experts).
    let (heads, kv_heads) = (slice.heads.start * hd..slice.heads.end * hd, slice.kv_heads.start * hd..slice.kv_heads.end * hd);
    let shard = |suffix: &str, t: QTensor, ffn: usize| -> candle_core::Result<QTensor> {
        if !tp {
            return Ok(t);
        }
        let t = match suffix.trim_end_matches("_exps").trim_end_matches("_shexp") {
            "attn_q" => RankSlice::rows_q(&t, heads.clone()),
            "attn_k" | "attn_v" => RankSlice::rows_q(&t, kv_heads.clone()),
            "attn_output" => RankSlice::columns_q(&t, heads.clone()),
            "ffn_gate" | "ffn_up" => RankSlice::rows_q(&t, slice.ffn(ffn)),
            "ffn_down" => RankSlice::columns_q(&t, slice.ffn(ffn)),
            _ => Ok(t),
        }
        .map_err(|e| candle_core::Error::Msg(format!("`{suffix}`: {e}")))?;
        to_device(t, device)
    };
    // The table (on the CPU as stored, its rows dequantized when looked up; dequantized whole elsewhere) and, for a
    // tied output projection on the rank that computes the logits, as stored. On the CPU, a tied table the kernels
    // take as stored is held once: the output projection's matrix (`tied_head`), its rows looked up there
    // ([`Embedding::Packed`]: the same values).
    let tied = slice.rank == 0 && !content.tensor_infos.contains_key("output.weight");
    let (embedding, embedding_q, tied_head) = match shared {
        Some(table) if slice.rank > 0 => (table.clone(), None, None),
        _ if device.is_cpu() => {
            let q = qtensor("token_embd.weight")?;
            let packed = match tied && matches!(layout, Layout::AsStored | Layout::Stored16(_)) {
                true => Packed::from_qtensor(&q).map_err(fmt)?.map(std::sync::Arc::new),
                false => None,
            };
            match packed {
                Some(p) => (Embedding::Packed { matrix: p.clone(), width }, None, Some(Matrix::Packed(p))),
                None => {
                    let table = Embedding::Stored { table: std::sync::Arc::new(q), width };
                    (table, if tied { Some(qtensor("token_embd.weight")?) } else { None }, None)
                }
            }
        }
        _ => {
            let q = qtensor("token_embd.weight")?;
            (Embedding::Dense(q.dequantize(device).and_then(|e| e.pad_with_zeros(1, 0, width - d)).map_err(fmt)?), Some(q), None)
        }
    };
    let (q, kv) = (config.heads * hd, config.kv_heads * hd);
    // (name, laid-out [rows, columns]), in the order `Layer` takes them.
    let shapes: [(&str, [usize; 2]); 7] = [
        ("attn_q", [q, width]),
        ("attn_k", [kv, width]),
        ("attn_v", [kv, width]),
        ("attn_output", [width, attn_width]),
        ("ffn_gate", [ffn_width, width]),
        ("ffn_up", [ffn_width, width]),
        ("ffn_down", [width, ffn_width]),
    ];
    // A mixture of experts' layers hold each of gate, up and down once per expert instead (every expert's gates,
    // then ups, then downs).
    let moe = config.moe.clone();
    let per_layer = match &moe {
        Some(m) => 4 + 3 * m.experts + if m.shared.is_some() { 3 } else { 0 },
        None => shapes.len(),
    };
    // The layers' matrices as read, an eighth of the layers at a time, each eighth laid out (requantized) in parallel
    // before the next is read: the file's copy of an eighth of the layers at a time beside the laid-out ones
    // (reading them all first made load peak at the file's size plus the weights'; a layer at a time left one of two
    // cores idle for most of a layer's matrices).
    let group = config.layers.div_ceil(8).max(1);
    let mut raw = Vec::with_capacity(group * per_layer);
    let mut laid_out: Vec<Matrix> = Vec::with_capacity(config.layers * per_layer);
    let fused = Fused::of(&content, &config);
    for i in 0..config.layers {
        // Phi-3's fused q/k/v and gate/up projections, split by rows (each row's blocks are its own: the parts are
        // the stored weights, bit for bit), on the host.
        let split = |suffix: &str, parts: &[usize]| -> Result<Vec<QTensor>, ModelError> {
            split_rows(read(&format!("blk.{i}.{suffix}.weight"), &Device::Cpu)?, parts, &Device::Cpu).map_err(fmt)
        };
        let mut qkv = match fused.qkv {
            true => split("attn_qkv", &[q, kv, kv])?.into_iter().map(Some).collect(),
            false => vec![None, None, None],
        };
        let mut gate_up = match fused.gate_up {
            true => split("ffn_up", &[config.ffn_size, config.ffn_size])?.into_iter().map(Some).collect(),
            false => vec![None, None],
        };
        for (suffix, pad) in shapes {
            let name = format!("blk.{i}.{suffix}.weight");
            if moe.is_some() && suffix.starts_with("ffn_") {
                let stack = read(&format!("blk.{i}.{suffix}_exps.weight"), &Device::Cpu)?;
                for t in split_experts(stack, &on).map_err(fmt)? {
                    raw.push((shard(suffix, t, config.ffn_size).map_err(fmt)?, pad));
                }
                continue;
            }
            let part = match suffix {
                "attn_q" => qkv[0].take(),
                "attn_k" => qkv[1].take(),
                "attn_v" => qkv[2].take(),
                "ffn_gate" => gate_up[0].take(),
                "ffn_up" => gate_up[1].take(),
                _ => None,
            };
            // Pairs `(i, i + head_dim / 2)` become adjacent ones: the rows are read on the host and reordered.
            let t = match (part, halves && (suffix == "attn_q" || suffix == "attn_k")) {
                (Some(t), true) => interleave_rows(t, hd, config.rotary_dim, &on).map_err(fmt)?,
                (Some(t), false) => to_device(t, &on).map_err(fmt)?,
                (None, true) => interleave_rows(read(&name, &Device::Cpu)?, hd, config.rotary_dim, &on).map_err(fmt)?,
                (None, false) => qtensor(&name)?,
            };
            raw.push((shard(suffix, t, config.ffn_size).map_err(fmt)?, pad));
        }
        // Qwen2-MoE's shared expert: gate, up and down, after the routed experts'.
        if let Some(s) = moe.as_ref().and_then(|m| m.shared) {
            for (suffix, pad) in [("ffn_gate_shexp", [s, width]), ("ffn_up_shexp", [s, width]), ("ffn_down_shexp", [width, s])] {
                raw.push((shard(suffix, qtensor(&format!("blk.{i}.{suffix}.weight"))?, s).map_err(fmt)?, pad));
            }
        }
        if !(i + 1).is_multiple_of(group) && i + 1 < config.layers {
            continue;
        }
        let layer: Vec<Matrix> = std::mem::take(&mut raw)
            .into_par_iter()
            .map(|(t, pad)| lay_out(t, pad[0], pad[1], layout, device).and_then(|t| matrix(t, layout, device)))
            .collect::<candle_core::Result<_>>()
            .map_err(fmt)?;
        laid_out.extend(layer);
        // The file's copies of these layers are freed: their pages go back now, not at the process's end.
        crate::alloc::release_free_memory();
    }
    let mut matrices = laid_out.into_iter();
    let mut layers = Vec::with_capacity(config.layers);
    let mut post_norms = Vec::new();
    for i in 0..config.layers {
        let mut next = || matrices.next().expect("the layer's matrices");
        let (wq, wk, wv, wo) = (next(), next(), next(), next());
        let ffn = match &moe {
            None => Ffn::Dense { gate: next(), up: next(), down: next() },
            Some(m) => {
                let mut take = |n: usize| (0..n).map(|_| next()).collect::<Vec<_>>();
                let (gates, ups, downs) = (take(m.experts), take(m.experts), take(m.experts));
                let experts = gates.into_iter().zip(ups).zip(downs).map(|((gate, up), down)| Expert { gate, up, down }).collect();
                // The router in f32 (as stored: llama.cpp never quantizes it), zero columns for a padded width.
                let router = read(&format!("blk.{i}.ffn_gate_inp.weight"), &Device::Cpu)?
                    .dequantize(&Device::Cpu)
                    .and_then(|w| w.pad_with_zeros(1, 0, width - d))
                    .and_then(|w| w.to_device(device))
                    .and_then(Router::new)
                    .map_err(fmt)?;
                let experts = Experts::new(router, experts, m);
                match m.shared {
                    None => Ffn::Experts(Box::new(experts)),
                    Some(_) => {
                        let expert = Expert { gate: next(), up: next(), down: next() };
                        // Its gate `[d]` as the router's last row, in f32 as stored.
                        let gate = read(&format!("blk.{i}.ffn_gate_inp_shexp.weight"), &Device::Cpu)?
                            .dequantize(&Device::Cpu)
                            .and_then(|w| w.reshape((1, d))?.pad_with_zeros(1, 0, width - d))
                            .map_err(fmt)?;
                        Ffn::Experts(Box::new(experts.with_shared(expert, gate).map_err(fmt)?))
                    }
                }
            }
        };
        let norm = |suffix: &str| -> Result<Tensor, ModelError> {
            let name = format!("blk.{i}.{suffix}.weight");
            let t = qtensor(&name)?;
            t.dequantize(device).and_then(|w| padded_norm(w, width)).map_err(fmt)
        };
        // A bias of this rank's heads.
        let heads_of = |t: Tensor, rows: &Range<usize>| if tp { RankSlice::rows_t(&t, rows.clone()).map_err(fmt) } else { Ok(t) };
        let attn_norm = norm("attn_norm")?;
        let ffn_norm = norm("ffn_norm")?;
        if config.gemma.is_some() {
            post_norms.push(PostNorms { attn: norm("post_attention_norm")?.into(), ffn: norm("post_ffw_norm")?.into() });
        }
        // A vector of the layer's in f32: biases and the per-head norms, `rotary` ones reordered as q and k rows are.
        let vector = |suffix: &str, rotary: bool| -> Result<Tensor, ModelError> {
            let name = format!("blk.{i}.{suffix}");
            let t = qtensor(&name)?;
            let t = t.dequantize(device).map_err(fmt)?;
            match rotary && halves {
                true => super::hf::interleave_halves(&t, hd, config.rotary_dim).map_err(fmt),
                false => Ok(t),
            }
        };
        let has = |suffix: &str| content.tensor_infos.contains_key(&format!("blk.{i}.{suffix}"));
        // Qwen2's q, k and v biases (required, as llama.cpp requires them); a llama file's, where it has them.
        let qkv_bias = match arch.qkv_bias || has("attn_q.bias") {
            true => Some([heads_of(vector("attn_q.bias", true)?, &heads)?, heads_of(vector("attn_k.bias", true)?, &kv_heads)?, heads_of(vector("attn_v.bias", false)?, &kv_heads)?]),
            false => None,
        };
        let wo_bias = match has("attn_output.bias") {
            true => Some(vector("attn_output.bias", false)?.pad_with_zeros(0, 0, width - d).map_err(fmt)?),
            false => None,
        };
        let qk_norm = match arch.qk_norm {
            true => Some([vector("attn_q_norm.weight", true)?, vector("attn_k_norm.weight", true)?]),
            false => None,
        };
        layers.push(Layer {
            attn_norm: attn_norm.into(),
            wq,
            wk,
            wv,
            wo,
            qkv_bias: vectors(qkv_bias),
            wo_bias: wo_bias.map(Vector::from),
            qk_norm: vectors(qk_norm),
            ffn_norm: ffn_norm.into(),
            ffn,
        });
    }
    let output_norm = qtensor("output_norm.weight")?;
    let output_norm = output_norm.dequantize(device).and_then(|w| padded_norm(w, width)).map_err(fmt)?;
    // Tied embeddings: without `output.weight`, the embedding matrix is the output projection. A tensor-parallel
    // model's logits are its first rank's alone.
    let stored = match (slice.rank == 0, content.tensor_infos.contains_key("output.weight")) {
        (false, _) => None,
        _ if tied_head.is_some() => None,
        (true, true) => Some(qtensor("output.weight")?),
        (true, false) => Some(embedding_q.ok_or_else(|| ModelError::Metadata("the first rank's embedding table was not read (a bug)".into()))?),
    };
    let lm_head = match stored {
        Some(t) => Some(lay_out(if tp { to_device(t, device).map_err(fmt)? } else { t }, config.vocab_size, width, layout.for_output(), device).and_then(|t| matrix(t, layout, device)).map_err(fmt)?),
        None => tied_head,
    };
    if tp {
        config.ffn_size = slice.ffn(config.ffn_size).len();
        (config.heads, config.kv_heads) = (slice.heads.len(), slice.kv_heads.len());
    }

    let weights = Weights { embedding, layers, post_norms, output_norm, lm_head, attn_width, layout };
    Ok((Model::assemble(config, device, weights), info))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;

    #[test]
    fn quantizing_in_row_chunks_gives_the_whole_matrix_bytes() {
        let device = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (2500, 768), &device).unwrap();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0] {
            let whole = QTensor::quantize(&w, dtype).unwrap();
            let chunked = quantize_rows(&w, dtype, &device).unwrap();
            assert_eq!(chunked.shape().dims(), &[2500, 768]);
            assert!(whole.data().unwrap() == chunked.data().unwrap(), "{dtype:?}");
        }
    }

    #[test]
    fn cpu_weights_choose_the_layout() {
        let config = |hidden: usize, heads: usize, ffn: usize| ModelConfig {
            architecture: "llama".into(),
            name: None,
            context_length: 2048,
            hidden_size: hidden,
            layers: 2,
            heads,
            kv_heads: heads,
            head_dim: 64,
            rotary_dim: 64,
            ffn_size: ffn,
            rms_eps: 1e-5,
            rope_base: 10000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            vocab_size: 1000,
            gemma: None,
            sliding: None,
            moe: None,
            long_rope: None,
        };
        let cpu = Device::Cpu;
        // SmolLM2-135M: 576 wide (padded to 768 adds a third), 9 heads of 64, 1536 in the feed-forward.
        let smollm2 = config(576, 9, 1536);
        assert_eq!(Layout::choose(&cpu, &smollm2, CpuWeights::AsStored), Layout::AsStored);
        assert_eq!(Layout::choose(&cpu, &smollm2, CpuWeights::Fast), Layout::Padded(GgmlDType::Q4K, GgmlDType::Q6K));
        assert_eq!(Layout::choose(&cpu, &smollm2, CpuWeights::Q8_0), Layout::Padded(GgmlDType::Q8_0, GgmlDType::Q8_0));
        // 320 wide would grow by more than a third (to 512): no padding, Q4_0/Q4_1 matrices in Q8_0.
        let narrow = config(320, 5, 1024);
        assert_eq!(Layout::choose(&cpu, &narrow, CpuWeights::Fast), Layout::Q8);
        assert_eq!(Layout::choose(&cpu, &narrow, CpuWeights::Q8_0), Layout::Q8);
        assert_eq!(Layout::choose(&cpu, &narrow, CpuWeights::AsStored), Layout::AsStored);
        assert_eq!(Layout::AsStored.name(), "as-stored");
        assert_eq!(Layout::Padded(GgmlDType::Q4K, GgmlDType::Q6K).name(), "requantized to q4_k, output q6_k, padded");
    }
}
