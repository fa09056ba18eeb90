//! Llama-family decoders from Hugging Face model directories: `config.json`, the weights in safetensors (one
//! `model.safetensors`, or the shards that `model.safetensors.index.json` names), `tokenizer.json`, and, when
//! present, `tokenizer_config.json` (chat template, BOS and EOS tokens, `add_bos_token`), `chat_template.jinja`
//! and `generation_config.json` (end tokens).
//!
//! Variants, from config.json's `model_type` (or `architectures`):
//! - `llama` (Llama 2 and 3, SmolLM): Llama 3's `rope_scaling` (`rope_type = "llama3"`) is applied to the RoPE
//!   frequencies; `attention_bias` adds biases to q, k, v and o.
//! - `mistral`: `head_dim` may differ from `hidden_size / num_attention_heads`.
//! - `qwen2`: biases on q, k and v.
//! - `qwen3`: per-head RMSNorm of queries and keys before RoPE; `head_dim` must be given.
//! - `phi3`: fused `qkv_proj` and `gate_up_proj`; its window over every layer; LongRoPE (`rope_scaling` of type
//!   `longrope` or `su`, [`long_rope`]); partial rotary (`partial_rotary_factor`, Phi-4-mini).
//! - `mixtral`, `qwen3_moe` and `qwen2_moe` ([`crate::engine::models::moe`]): Mistral's, Qwen3's and Qwen2's layers
//!   with a mixture of SwiGLU experts in place of the feed-forward network (`num_local_experts` or `num_experts`,
//!   `num_experts_per_tok`; the Qwens' `moe_intermediate_size` and `norm_topk_prob`; Qwen2-MoE's shared expert,
//!   `shared_expert_intermediate_size` wide, and its sigmoid gate).
//! - `gemma2` and `gemma3_text` ([`crate::engine::models::gemma`]): RMSNorm weights stored as `w` for `1 + w` (the
//!   one added at load, in f32, before the weights take the compute dtype), norms after attention and the
//!   feed-forward network (`post_attention_layernorm` is the first; `pre_feedforward_layernorm` the norm before the
//!   feed-forward network), GeGLU (`gelu_pytorch_tanh`), `query_pre_attn_scalar`, soft-capping, sliding-window layers
//!   (`layer_types`, or Gemma 2's every other layer, Gemma 3's `sliding_window_pattern`) and Gemma 3's
//!   `rope_local_base_freq`; Gemma 3's linear `rope_scaling` applies to its global layers.
//!
//! and tied input and output embeddings (`tie_word_embeddings`) in any of them.
//!
//! Weights are converted to f32 at load (f16 and bf16 exactly) and multiplied as dense f32 matrices by candle's
//! gemm: the model computes what the checkpoint holds, with no requantization (the GGUF loader's [`super::Layout`]),
//! at 4 bytes per weight, twice a bf16 checkpoint's size in memory.
//!
//! RoPE: Hugging Face checkpoints rotate pairs of values `(i, i + head_dim / 2)` ("rotate half"); the forward
//! pass rotates adjacent pairs `(2i, 2i + 1)`, as GGUF's llama weights are permuted for. So the rows of the q and
//! k projections (with their biases, and Qwen3's q and k norm weights) are permuted at load, within each head,
//! to put row `i + head_dim / 2` next to row `i` ([`interleave_halves`]). Attention scores are dot products of
//! a query and a key permuted alike, so they are unchanged; values are not touched.
//!
//! Sliding-window attention of every layer (Mistral v0.1's and Mixtral's `sliding_window`, Phi-3's) slides in the
//! attention backends, as Gemma's sliding layers do, over the model's whole context; the KV blocks a sequence has
//! left behind its window are given back as it runs. Qwen's `use_sliding_window` (whose `max_window_layers` picks
//! the layers) caps the context at the window instead, where full attention computes the same function.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::quantized::QMatMul;

use crate::engine::kernels::Matrix;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use serde_json::Value;

use crate::engine::parallel::RankSlice;
use super::layers::{vectors, Ffn};
use crate::engine::models::moe::{Expert, Experts, Router};
use super::{Embedding, Layer, Model, ModelConfig, ModelInfo, RopeScaling, Weights, MAX_CONTEXT};
use crate::engine::models::gemma::{GemmaConfig, PostNorms};
use crate::engine::models::Sliding;
use crate::job::{ComputeDtype, CpuWeights};
use crate::engine::ModelError;
use crate::tokenize::vocab::{VocabMetadata, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};

/// The keys of `config.json` this loader reads; the rest are ignored.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default)]
    architectures: Option<Vec<String>>,
    #[serde(default, rename = "_name_or_path")]
    name_or_path: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    vocab_size: usize,
    #[serde(default)]
    rms_norm_eps: Option<f64>,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<Value>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    hidden_act: Option<String>,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: Option<bool>,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    #[serde(default)]
    bos_token_id: Option<Value>,
    #[serde(default)]
    eos_token_id: Option<Value>,
    #[serde(default)]
    hidden_activation: Option<String>,
    #[serde(default)]
    query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
    #[serde(default)]
    sliding_window_pattern: Option<usize>,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    rope_local_base_freq: Option<f64>,
    #[serde(default)]
    partial_rotary_factor: Option<f64>,
    /// Phi-3's pre-trained context, for LongRoPE.
    #[serde(default)]
    original_max_position_embeddings: Option<usize>,
    /// Mixtral's experts per layer.
    #[serde(default)]
    num_local_experts: Option<usize>,
    /// Qwen3-MoE's experts per layer.
    #[serde(default)]
    num_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    /// OLMoE's clamp of q, k and v (null in the published models): refused where set.
    #[serde(default)]
    clip_qkv: Option<f64>,
    shared_expert_intermediate_size: Option<usize>,
    #[serde(default)]
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Option<Vec<usize>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Phi3,
    Mixtral,
    Qwen3Moe,
    Qwen2Moe,
    Olmoe,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Olmoe => "olmoe",
        }
    }

    fn gemma(self) -> Option<u8> {
        match self {
            Family::Gemma2 => Some(2),
            Family::Gemma3 => Some(3),
            _ => None,
        }
    }

    fn of(config: &HfConfig) -> Result<Family, ModelError> {
        let by_type = |t: &str| match t {
            "llama" => Some(Family::Llama),
            "mistral" => Some(Family::Mistral),
            "qwen2" => Some(Family::Qwen2),
            "qwen3" => Some(Family::Qwen3),
            "gemma2" => Some(Family::Gemma2),
            "gemma3_text" => Some(Family::Gemma3),
            "phi3" => Some(Family::Phi3),
            "mixtral" => Some(Family::Mixtral),
            "qwen3_moe" => Some(Family::Qwen3Moe),
            "qwen2_moe" => Some(Family::Qwen2Moe),
            "olmoe" => Some(Family::Olmoe),
            _ => None,
        };
        let by_class = |c: &str| match c {
            "LlamaForCausalLM" => Some(Family::Llama),
            "MistralForCausalLM" => Some(Family::Mistral),
            "Qwen2ForCausalLM" => Some(Family::Qwen2),
            "Qwen3ForCausalLM" => Some(Family::Qwen3),
            "Gemma2ForCausalLM" => Some(Family::Gemma2),
            "Gemma3ForCausalLM" => Some(Family::Gemma3),
            "Phi3ForCausalLM" => Some(Family::Phi3),
            "MixtralForCausalLM" => Some(Family::Mixtral),
            "Qwen3MoeForCausalLM" => Some(Family::Qwen3Moe),
            "Qwen2MoeForCausalLM" => Some(Family::Qwen2Moe),
            "OlmoeForCausalLM" => Some(Family::Olmoe),
            _ => None,
        };
        let class = config.architectures.as_ref().and_then(|a| a.first());
        let found = match (&config.model_type, class) {
            (Some(t), _) => by_type(t).ok_or_else(|| t.clone()),
            (None, Some(c)) => by_class(c).ok_or_else(|| c.clone()),
            (None, None) => Err("none given".to_string()),
        };
        found.map_err(|name| ModelError::Architecture { name, supported: "llama, mistral, mixtral, qwen2, qwen3, qwen2_moe, qwen3_moe, olmoe, gemma2, gemma3_text and phi3 in Hugging Face directories" })
    }
}

/// Which optional tensors a checkpoint has, from its family and config.
#[derive(Clone, Copy, Debug)]
struct Variant {
    qkv_bias: bool,
    wo_bias: bool,
    qk_norm: bool,
    /// OLMoE's q/k norms over the whole q and k rows, not per head.
    qk_norm_rows: bool,
    tied: bool,
    /// Gemma's norms after attention and the feed-forward network (and its norm weights stored as `w` for `1 + w`).
    post_norms: bool,
    /// Phi-3's fused `qkv_proj` (rows q, k, v) and `gate_up_proj` (rows gate, up).
    fused: bool,
    /// How a mixture of experts names its router and experts' matrices.
    experts: Option<ExpertNames>,
}

/// A mixture of experts' tensor names under `model.layers.{i}.`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExpertNames {
    /// `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).
    Mixtral,
    /// `mlp.gate` and `mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj` (Qwen2-MoE's too, with its shared
    /// expert's `mlp.shared_expert.{gate,up,down}_proj` and gate `mlp.shared_expert_gate`).
    Qwen3Moe,
}

impl ExpertNames {
    fn router(self) -> &'static str {
        match self {
            ExpertNames::Mixtral => "block_sparse_moe.gate.weight",
            ExpertNames::Qwen3Moe => "mlp.gate.weight",
        }
    }

    /// Expert `e`'s gate, up and down.
    fn expert(self, e: usize) -> [String; 3] {
        match self {
            ExpertNames::Mixtral => ["w1", "w3", "w2"].map(|w| format!("block_sparse_moe.experts.{e}.{w}.weight")),
            ExpertNames::Qwen3Moe => ["gate_proj", "up_proj", "down_proj"].map(|w| format!("mlp.experts.{e}.{w}.weight")),
        }
    }
}

/// A mixture of experts' keys of config.json: Mixtral's `num_local_experts` (its chosen experts' weights always
/// renormalized, as Hugging Face's Mixtral computes them), Qwen3-MoE's `num_experts`, `moe_intermediate_size` and
/// `norm_topk_prob`; `num_experts_per_tok` for both. Qwen3-MoE's dense layers (`mlp_only_layers`,
/// `decoder_sparse_step` above 1) are refused, as llama.cpp has none either.
fn moe_config(c: &HfConfig, family: Family) -> Result<Option<(crate::engine::models::moe::MoeConfig, usize)>, ModelError> {
    let (experts, size, normalize) = match family {
        Family::Mixtral => (c.num_local_experts, c.intermediate_size, true),
        // OLMoE's experts are `intermediate_size` wide; Hugging Face's OLMoE renormalizes where `norm_topk_prob`.
        Family::Olmoe => (c.num_experts, c.intermediate_size, c.norm_topk_prob.unwrap_or(false)),
        Family::Qwen3Moe | Family::Qwen2Moe => {
            if c.mlp_only_layers.as_ref().is_some_and(|l| !l.is_empty()) || c.decoder_sparse_step.is_some_and(|s| s != 1) {
                return Err(invalid("dense layers among the experts' (`mlp_only_layers`, `decoder_sparse_step`) are not supported".into()));
            }
            let size = c.moe_intermediate_size.ok_or_else(|| invalid(format!("a {} model must give `moe_intermediate_size`", family.name())))?;
            (c.num_experts, size, c.norm_topk_prob.unwrap_or(false))
        }
        _ => return Ok(None),
    };
    let experts = experts.ok_or_else(|| invalid(format!("a {} model must give its number of experts", family.name())))?;
    let used = c.num_experts_per_tok.ok_or_else(|| invalid("`num_experts_per_tok` is missing".into()))?;
    if size == 0 || size > 1 << 20 {
        return Err(invalid(format!("experts' feed-forward size {size} is outside 1..=1048576")));
    }
    let moe = crate::engine::models::moe::MoeConfig::new(experts, used, normalize).map_err(|e| invalid(e.to_string()))?;
    // Qwen2-MoE's shared expert, `shared_expert_intermediate_size` wide.
    let moe = match family {
        Family::Qwen2Moe => {
            let width = c.shared_expert_intermediate_size.ok_or_else(|| invalid("a qwen2_moe model must give `shared_expert_intermediate_size`".into()))?;
            moe.with_shared(width).map_err(|e| invalid(e.to_string()))?
        }
        _ => moe,
    };
    Ok(Some((moe, size)))
}

/// Gemma's keys of config.json ([`GemmaConfig`]), with Hugging Face's defaults: the query scale of `head_dim`,
/// Gemma 2's every other layer sliding (`layer_idx % 2 == 0`), Gemma 3's five in six
/// (`(layer_idx + 1) % sliding_window_pattern != 0`, pattern 6) unless `layer_types` lists them, Gemma 3's local
/// RoPE base of 10,000 (Gemma 2's local layers rotate as its global ones).
fn gemma_config(c: &HfConfig, version: u8, head_dim: usize, rope_base: f32) -> Result<(GemmaConfig, Option<Sliding>), ModelError> {
    let positive = |key: &str, v: Option<f64>| -> Result<Option<f32>, ModelError> {
        match v {
            Some(v) if !(v.is_finite() && v > 0.0) => Err(invalid(format!("`{key}` is {v}: it must be positive"))),
            other => Ok(other.map(|v| v as f32)),
        }
    };
    let layers = c.num_hidden_layers;
    let sliding = match c.sliding_window {
        None | Some(0) => None,
        Some(window) => {
            let layers = match &c.layer_types {
                Some(types) if types.len() == layers => types.iter().map(|t| t == "sliding_attention").collect(),
                Some(types) => return Err(invalid(format!("`layer_types` lists {} layers of {layers}", types.len()))),
                None if version == 2 => (0..layers).map(|l| l % 2 == 0).collect(),
                None => {
                    let period = c.sliding_window_pattern.unwrap_or(6).max(1);
                    (0..layers).map(|l| (l + 1) % period != 0).collect()
                }
            };
            let local = if version == 2 { Some(rope_base) } else { positive("rope_local_base_freq", c.rope_local_base_freq)? };
            Some(Sliding { window, layers, rope_base: local.unwrap_or(10_000.0) })
        }
    };
    let config = GemmaConfig {
        version,
        query_pre_attn_scalar: positive("query_pre_attn_scalar", c.query_pre_attn_scalar)?.unwrap_or(head_dim as f32),
        attn_softcap: positive("attn_logit_softcapping", c.attn_logit_softcapping)?,
        final_softcap: positive("final_logit_softcapping", c.final_logit_softcapping)?,
    };
    Ok((config, sliding))
}

/// A linear `rope_scaling`'s factor (Gemma 3's global layers); `None` without one.
fn linear_rope_factor(value: Option<&Value>) -> Result<Option<f64>, ModelError> {
    let Some(object) = value.filter(|v| !v.is_null()) else { return Ok(None) };
    match object.get("rope_type").or_else(|| object.get("type")).and_then(Value::as_str) {
        Some("linear") => {}
        Some("default") | None => return Ok(None),
        Some(other) => return Err(invalid(format!("rope_scaling type `{other}` is not supported for Gemma (supported: linear)"))),
    }
    match object.get("factor").and_then(Value::as_f64) {
        Some(f) if f.is_finite() && f > 0.0 => Ok(Some(f)),
        _ => Err(invalid("rope_scaling.factor must be a positive number".into())),
    }
}

/// Phi-3's LongRoPE (`rope_scaling.type` `longrope`, or `su` in the first 128k checkpoints): the long factors when the
/// model's context exceeds its pre-trained one (`original_max_position_embeddings`), the short ones otherwise, as
/// llama.cpp chooses by the context it serves (its converter writes both sets); the attention factor
/// (`rope_scaling.attention_factor`, or `sqrt(1 + ln(scale) / ln(original))` of the context's scale over the
/// pre-trained one, as Hugging Face's and llama.cpp's converter compute it). `None` without LongRoPE.
/// LongRoPE from `rope_scaling`: its factor set (one per rotated pair: `rotary_dim / 2`) and its choice.
fn long_rope(c: &HfConfig, rotary_dim: usize) -> Result<Option<(super::LongRope, Vec<f32>)>, ModelError> {
    let Some(object) = c.rope_scaling.as_ref().filter(|v| !v.is_null()) else { return Ok(None) };
    match object.get("rope_type").or_else(|| object.get("type")).and_then(Value::as_str) {
        Some("longrope" | "su") => {}
        _ => return Ok(None),
    }
    let factors = |key: &str| -> Result<Vec<f32>, ModelError> {
        let values: Option<Vec<f32>> = object.get(key).and_then(Value::as_array).and_then(|a| a.iter().map(|v| v.as_f64().map(|f| f as f32)).collect());
        match values {
            Some(v) if v.len() == rotary_dim / 2 && v.iter().all(|f| f.is_finite() && *f > 0.0) => Ok(v),
            _ => Err(invalid(format!("rope_scaling.{key} must be {} positive numbers", rotary_dim / 2))),
        }
    };
    let original = object
        .get("original_max_position_embeddings")
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .or(c.original_max_position_embeddings)
        .filter(|&o| o > 0)
        .ok_or_else(|| invalid("LongRoPE needs `original_max_position_embeddings`".into()))?;
    let scale = c.max_position_embeddings as f64 / original as f64;
    let attn_factor = match object.get("attention_factor").and_then(Value::as_f64) {
        Some(f) if f.is_finite() && f > 0.0 => f,
        Some(f) => return Err(invalid(format!("rope_scaling.attention_factor is {f}"))),
        None if scale > 1.0 => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
        None => 1.0,
    };
    let long = c.max_position_embeddings > original;
    let chosen = factors(if long { "long_factor" } else { "short_factor" })?;
    factors(if long { "short_factor" } else { "long_factor" })?;
    Ok(Some((super::LongRope { long, original_context: original, attn_factor: attn_factor as f32 }, chosen)))
}

fn invalid(message: String) -> ModelError {
    ModelError::Metadata(format!("config.json: {message}"))
}

/// The model's configuration and variant from `config.json`, every value checked before anything is allocated
/// from it.
fn model_config(c: &HfConfig, dir: &Path) -> Result<(ModelConfig, Variant), ModelError> {
    let family = Family::of(c)?;
    let heads = c.num_attention_heads;
    let kv_heads = c.num_key_value_heads.unwrap_or(heads);
    if heads == 0 || heads > 1024 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(invalid(format!("{heads} attention heads and {kv_heads} key/value heads do not fit")));
    }
    let head_dim = match (c.head_dim, family) {
        (Some(hd), _) => hd,
        (None, Family::Qwen3 | Family::Qwen3Moe) => return Err(invalid(format!("a {} model must give `head_dim`", family.name()))),
        (None, _) if c.hidden_size.is_multiple_of(heads) => c.hidden_size / heads,
        (None, _) => return Err(invalid(format!("hidden size {} is not a multiple of {heads} heads", c.hidden_size))),
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > 1024 {
        return Err(invalid(format!("head size {head_dim} must be even, between 2 and 1024")));
    }
    let bounded = [
        ("hidden_size", c.hidden_size, 1 << 16),
        ("intermediate_size", c.intermediate_size, 1 << 20),
        ("num_hidden_layers", c.num_hidden_layers, 1024),
        ("vocab_size", c.vocab_size, 1 << 22),
        ("max_position_embeddings", c.max_position_embeddings, MAX_CONTEXT),
    ];
    for (key, value, max) in bounded {
        if value == 0 || value > max {
            return Err(invalid(format!("`{key}` is {value}, outside 1..={max}")));
        }
    }
    // Gemma's GeGLU, named by `hidden_activation` (which Hugging Face's Gemma reads over `hidden_act`), or by
    // `hidden_act` in configs without it; SwiGLU elsewhere.
    let wanted = if family.gemma().is_some() { "gelu_pytorch_tanh" } else { "silu" };
    let moe = moe_config(c, family)?;
    let (key, act) = match (&c.hidden_activation, family.gemma()) {
        (Some(act), Some(_)) => ("hidden_activation", Some(act)),
        _ => ("hidden_act", c.hidden_act.as_ref()),
    };
    if let Some(act) = act.filter(|a| a.as_str() != wanted) {
        return Err(invalid(format!("{key} `{act}` is not supported ({wanted} only for {})", family.name())));
    }
    // Partial rotary (Phi-4-mini's 0.75): the first `head_dim x factor` values of each head rotate, as Hugging Face's
    // `int(head_dim * partial_rotary_factor)`.
    let rotary_dim = match c.partial_rotary_factor {
        None => head_dim,
        Some(1.0) => head_dim,
        // Hugging Face's other families here rotate whole heads whatever the key says (or fail on it).
        Some(f) if family != Family::Phi3 => return Err(invalid(format!("`partial_rotary_factor` {f} is not supported for {}: it rotates whole heads", family.name()))),
        Some(f) if f.is_finite() && f > 0.0 && f <= 1.0 && ((head_dim as f64 * f) as usize).is_multiple_of(2) && (head_dim as f64 * f) as usize >= 2 => (head_dim as f64 * f) as usize,
        Some(f) => return Err(invalid(format!("`partial_rotary_factor` {f} must rotate an even number of a head's {head_dim} values, at least 2"))),
    };
    if let Some(clip) = c.clip_qkv {
        return Err(invalid(format!("`clip_qkv` {clip} is not supported (null: no clamp)")));
    }
    if c.mlp_bias == Some(true) {
        return Err(invalid("`mlp_bias` is not supported".into()));
    }
    let rms_eps = c.rms_norm_eps.unwrap_or(1e-6);
    let rope_base = c.rope_theta.unwrap_or(10_000.0);
    if !(rms_eps.is_finite() && rms_eps > 0.0 && rope_base.is_finite() && rope_base > 1.0) {
        return Err(invalid(format!("rms_norm_eps {rms_eps} or rope_theta {rope_base} is out of range")));
    }
    // Gemma 3's linear scaling (positions divided by the factor) of its global layers, as GGUF's is read.
    let linear = match family.gemma() {
        Some(_) => linear_rope_factor(c.rope_scaling.as_ref())?,
        None => None,
    };
    let long_rope = match family {
        Family::Phi3 => long_rope(c, rotary_dim)?,
        _ => None,
    };
    let rope_scaling = if linear.is_some() || long_rope.is_some() { None } else { rope_scaling(c.rope_scaling.as_ref())? };
    // Qwen's sliding window: full attention over a context no longer than the window computes the same function.
    let window = match family {
        Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe | Family::Qwen2Moe => c.sliding_window.filter(|_| c.use_sliding_window == Some(true)),
        Family::Llama | Family::Mistral | Family::Mixtral | Family::Gemma2 | Family::Gemma3 | Family::Phi3 | Family::Olmoe => None,
    };
    let mut context_length = c.max_position_embeddings;
    if let Some(w) = window.filter(|&w| w < context_length) {
        if w == 0 {
            return Err(invalid("`sliding_window` is 0".into()));
        }
        tracing::info!(window = w, declared = context_length, "context capped at the sliding window");
        context_length = w;
    }
    // The RoPE tables take 8 bytes per position and pair of values.
    if context_length * head_dim > 1 << 28 {
        return Err(invalid(format!("a context of {context_length} positions with head size {head_dim} is too large")));
    }
    let attention_bias = c.attention_bias.unwrap_or(false);
    let variant = Variant {
        qkv_bias: matches!(family, Family::Qwen2 | Family::Qwen2Moe) || (attention_bias && family != Family::Mistral),
        wo_bias: attention_bias && matches!(family, Family::Llama | Family::Qwen3 | Family::Qwen3Moe),
        qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3 | Family::Olmoe),
        qk_norm_rows: family == Family::Olmoe,
        // Gemma's configuration classes tie by default.
        tied: c.tie_word_embeddings.unwrap_or(family.gemma().is_some()),
        post_norms: family.gemma().is_some(),
        fused: family == Family::Phi3,
        experts: match family {
            Family::Mixtral => Some(ExpertNames::Mixtral),
            Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe => Some(ExpertNames::Qwen3Moe),
            _ => None,
        },
    };
    let (gemma, sliding) = match family.gemma() {
        Some(version) => {
            let (gemma, sliding) = gemma_config(c, version, head_dim, rope_base as f32)?;
            (Some(gemma), sliding)
        }
        // Phi-3's, Mistral's and Mixtral's window over every layer slides in the attention backends.
        None if matches!(family, Family::Phi3 | Family::Mistral | Family::Mixtral) => {
            if c.sliding_window == Some(0) {
                return Err(invalid("`sliding_window` is 0".into()));
            }
            (None, c.sliding_window.filter(|&w| w < c.max_position_embeddings).map(|w| Sliding::every_layer(w, c.num_hidden_layers, rope_base as f32)))
        }
        None => (None, None),
    };
    let name = c.name_or_path.clone().filter(|n| !n.is_empty()).or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned()));
    let config = ModelConfig {
        architecture: family.name().to_string(),
        name,
        context_length,
        hidden_size: c.hidden_size,
        layers: c.num_hidden_layers,
        heads,
        kv_heads,
        head_dim,
        rotary_dim,
        ffn_size: moe.as_ref().map_or(c.intermediate_size, |m| m.1),
        rms_eps: rms_eps as f32,
        rope_base: rope_base as f32,
        rope_scaling,
        rope_freq_factors: match &long_rope {
            Some((_, factors)) => Some(factors.clone()),
            None => linear.map(|f| vec![f as f32; rotary_dim / 2]),
        },
        vocab_size: c.vocab_size,
        gemma,
        sliding,
        moe: moe.map(|m| m.0),
        long_rope: long_rope.map(|l| l.0),
    };
    Ok((config, variant))
}

fn rope_scaling(value: Option<&Value>) -> Result<Option<RopeScaling>, ModelError> {
    let Some(object) = value.filter(|v| !v.is_null()) else { return Ok(None) };
    let kind = object.get("rope_type").or_else(|| object.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => return Ok(None),
        "llama3" => {}
        other => return Err(invalid(format!("rope_scaling type `{other}` is not supported (supported: llama3)"))),
    }
    let number = |key: &str| -> Result<f64, ModelError> {
        object
            .get(key)
            .and_then(Value::as_f64)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| invalid(format!("rope_scaling.{key} must be a positive number")))
    };
    let scaling = RopeScaling {
        factor: number("factor")?,
        low_freq_factor: number("low_freq_factor")?,
        high_freq_factor: number("high_freq_factor")?,
        original_context: number("original_max_position_embeddings")? as usize,
    };
    if scaling.high_freq_factor <= scaling.low_freq_factor || scaling.original_context == 0 {
        return Err(invalid("rope_scaling needs high_freq_factor > low_freq_factor and a context of 1 or more".into()));
    }
    Ok(Some(scaling))
}

fn read_json(path: &Path) -> Result<Option<Value>, ModelError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| ModelError::Metadata(format!("`{}` is not valid JSON: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ModelError::Open { path: path.into(), source }),
    }
}

fn unreadable(path: &Path, error: impl std::fmt::Display) -> ModelError {
    ModelError::Open { path: path.into(), source: std::io::Error::new(std::io::ErrorKind::InvalidData, error.to_string()) }
}

/// The safetensors files of a checkpoint, memory-mapped, and which file holds each tensor.
struct Shards {
    files: Vec<(PathBuf, MmapedSafetensors)>,
    routing: HashMap<String, usize>,
}

impl Shards {
    /// `model.safetensors.index.json`'s shards when the index exists, `model.safetensors` otherwise.
    fn open(dir: &Path) -> Result<Shards, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = match read_json(&index_path)? {
            Some(index) => {
                let map = index.get("weight_map").and_then(Value::as_object).ok_or_else(|| {
                    ModelError::Metadata(format!("`{}` has no `weight_map` object", index_path.display()))
                })?;
                let mut names = BTreeSet::new();
                for file in map.values() {
                    let file = file.as_str().filter(|f| Path::new(f).file_name() == Some(std::ffi::OsStr::new(f)));
                    let file = file.ok_or_else(|| {
                        ModelError::Metadata(format!("`{}` names a shard that is not a file name in the directory", index_path.display()))
                    })?;
                    names.insert(file.to_string());
                }
                names.into_iter().map(|f| dir.join(f)).collect()
            }
            None => vec![dir.join("model.safetensors")],
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut routing = HashMap::new();
        for path in paths {
            if !path.is_file() {
                return Err(ModelError::Open { path, source: std::io::ErrorKind::NotFound.into() });
            }
            // SAFETY: the mapping is only read, and a checkpoint is not rewritten while a job reads it; candle
            // checks the header's offsets against the file's length, so a truncated file is an error here.
            let mapped = unsafe { MmapedSafetensors::new(&path) }.map_err(|e| unreadable(&path, e))?;
            for (name, _) in mapped.tensors() {
                routing.insert(name, files.len());
            }
            files.push((path, mapped));
        }
        Ok(Shards { files, routing })
    }

    /// The dtype a tensor is stored in, as candle names it; `None` for a missing tensor or a dtype candle lacks.
    fn stored_dtype(&self, name: &str) -> Option<DType> {
        let &index = self.routing.get(name)?;
        let view = self.files[index].1.get(name).ok()?;
        DType::try_from(view.dtype()).ok()
    }

    /// Shape and dtype of a tensor, without reading its data.
    fn describe(&self, name: &str) -> Option<(Vec<usize>, String)> {
        let &index = self.routing.get(name)?;
        let view = self.files[index].1.get(name).ok()?;
        Some((view.shape().to_vec(), format!("{:?}", view.dtype()).to_lowercase()))
    }

    /// A tensor, copied out of its file's mapping (in `dtype`, on `device`). The mapping's pages it was read from
    /// are then handed back ([`crate::host::release_pages`]): read once, they would otherwise count in the
    /// process's memory until every shard is closed, beside the copies (a bf16 checkpoint's peak was about twice
    /// its weights).
    fn load(&self, name: &str, device: &Device, dtype: DType) -> Result<Tensor, ModelError> {
        let index = *self.routing.get(name).ok_or_else(|| ModelError::Metadata(format!("tensor `{name}` is missing")))?;
        let (path, mapped) = &self.files[index];
        let tensor = mapped.load(name, device).and_then(|t| t.to_dtype(dtype)).map_err(|e| unreadable(path, e))?;
        if let Ok(view) = mapped.get(name) {
            // SAFETY: a view's data lies in candle's read-only mapping of the shard (`MmapedSafetensors` keeps each
            // file's `memmap2::Mmap` and borrows the views from it), which nothing writes; the file is not changed
            // while a job reads it, as mapping it already assumed (`Shards::open`).
            unsafe { crate::host::release_pages(view.data()) };
        }
        Ok(tensor)
    }

    /// Every tensor's bytes as stored.
    fn stored_weights(&self) -> super::StoredWeights {
        let mut weights = super::StoredWeights::default();
        for (_, mapped) in &self.files {
            for (name, view) in mapped.tensors() {
                weights.add(&name, view.data().len() as u64);
            }
        }
        weights
    }

    /// Tensor dtypes and how many tensors have each.
    fn dtype_counts(&self) -> Vec<(String, usize)> {
        let mut counts = BTreeMap::new();
        for (_, mapped) in &self.files {
            for (_, view) in mapped.tensors() {
                *counts.entry(format!("{:?}", view.dtype()).to_lowercase()).or_insert(0) += 1;
            }
        }
        counts.into_iter().collect()
    }
}

/// Every tensor the model reads, with its shape, in load order.
fn expected_tensors(c: &ModelConfig, v: Variant) -> Vec<(String, Vec<usize>)> {
    let (d, hd, f) = (c.hidden_size, c.head_dim, c.ffn_size);
    let (q, kv) = (c.heads * hd, c.kv_heads * hd);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, d]), ("model.norm.weight".to_string(), vec![d])];
    if !v.tied {
        out.push(("lm_head.weight".into(), vec![c.vocab_size, d]));
    }
    for i in 0..c.layers {
        let mut add = |suffix: &str, dims: Vec<usize>| out.push((format!("model.layers.{i}.{suffix}"), dims));
        add("input_layernorm.weight", vec![d]);
        add("post_attention_layernorm.weight", vec![d]);
        if v.post_norms {
            add("pre_feedforward_layernorm.weight", vec![d]);
            add("post_feedforward_layernorm.weight", vec![d]);
        }
        if v.fused {
            add("self_attn.qkv_proj.weight", vec![q + 2 * kv, d]);
        } else {
            add("self_attn.q_proj.weight", vec![q, d]);
            add("self_attn.k_proj.weight", vec![kv, d]);
            add("self_attn.v_proj.weight", vec![kv, d]);
        }
        add("self_attn.o_proj.weight", vec![d, q]);
        if v.qkv_bias {
            add("self_attn.q_proj.bias", vec![q]);
            add("self_attn.k_proj.bias", vec![kv]);
            add("self_attn.v_proj.bias", vec![kv]);
        }
        if v.wo_bias {
            add("self_attn.o_proj.bias", vec![d]);
        }
        if v.qk_norm {
            let (qn, kn) = if v.qk_norm_rows { (q, kv) } else { (hd, hd) };
            add("self_attn.q_norm.weight", vec![qn]);
            add("self_attn.k_norm.weight", vec![kn]);
        }
        match (v.experts, &c.moe) {
            (Some(names), Some(moe)) => {
                add(names.router(), vec![moe.experts, d]);
                for e in 0..moe.experts {
                    let [gate, up, down] = names.expert(e);
                    add(&gate, vec![f, d]);
                    add(&up, vec![f, d]);
                    add(&down, vec![d, f]);
                }
                if let Some(s) = moe.shared {
                    add("mlp.shared_expert.gate_proj.weight", vec![s, d]);
                    add("mlp.shared_expert.up_proj.weight", vec![s, d]);
                    add("mlp.shared_expert.down_proj.weight", vec![d, s]);
                    add("mlp.shared_expert_gate.weight", vec![1, d]);
                }
            }
            _ if v.fused => {
                add("mlp.gate_up_proj.weight", vec![2 * f, d]);
                add("mlp.down_proj.weight", vec![d, f]);
            }
            _ => {
                add("mlp.gate_proj.weight", vec![f, d]);
                add("mlp.up_proj.weight", vec![f, d]);
                add("mlp.down_proj.weight", vec![d, f]);
            }
        }
    }
    out
}

/// A checkpoint directory with its configuration, tokenizer and tensor headers read and checked.
struct Checkpoint {
    info: ModelInfo,
    variant: Variant,
    shards: Shards,
}

impl Checkpoint {
    fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let config_path = dir.join("config.json");
        let raw = read_json(&config_path)?.ok_or_else(|| ModelError::Open { path: config_path.clone(), source: std::io::ErrorKind::NotFound.into() })?;
        let hf: HfConfig = serde_json::from_value(raw).map_err(|e| invalid(e.to_string()))?;
        let (config, variant) = model_config(&hf, dir)?;
        let shards = Shards::open(dir)?;
        for (name, dims) in expected_tensors(&config, variant) {
            let (shape, dtype) = shards.describe(&name).ok_or_else(|| ModelError::Metadata(format!("tensor `{name}` is missing")))?;
            if shape != dims {
                return Err(ModelError::Metadata(format!("tensor `{name}` has shape {shape:?}, expected {dims:?}")));
            }
            if !matches!(dtype.as_str(), "f32" | "f16" | "bf16") {
                return Err(ModelError::Metadata(format!("tensor `{name}` is {dtype}; supported: f32, f16, bf16")));
            }
        }
        let vocab = vocab(dir, &hf, config.vocab_size)?;
        super::check_vocab(&vocab, config.vocab_size)?;
        let info = ModelInfo { config, vocab, tensor_types: shards.dtype_counts(), weights: shards.stored_weights() };
        Ok(Checkpoint { info, variant, shards })
    }
}

/// Reads a Hugging Face directory's configuration and tokenizer, and checks its tensors' names and shapes,
/// without reading weights.
pub fn inspect(dir: &Path) -> Result<ModelInfo, ModelError> {
    Checkpoint::open(dir).map(|c| c.info)
}

/// The dtype weights and activations are computed in (`runtime.dtype`): `auto` is f32 on the CPU (candle's CPU
/// gemm has no fast bf16 path), bf16 on an accelerator (Hugging Face's and vLLM's default for these checkpoints; an
/// f16 checkpoint is converted, as its range fits).
pub fn compute_dtype(device: &Device, asked: ComputeDtype) -> DType {
    match asked {
        ComputeDtype::F32 => DType::F32,
        ComputeDtype::Bf16 => DType::BF16,
        ComputeDtype::F16 => DType::F16,
        ComputeDtype::Auto if device.is_cpu() => DType::F32,
        ComputeDtype::Auto => DType::BF16,
    }
}

/// Loads a Hugging Face directory's decoder onto `device`, weights in `dtype` (`None`: [`compute_dtype`]'s).
/// Loads the model, or a tensor-parallel rank's slice of it (`slice`), with another rank's embedding table where
/// one is given (`shared`: then neither read nor held twice).
///
/// On the CPU in f32 (the default there), the 16-bit matrices of a bf16 or f16 checkpoint stay in 16 bits on
/// nightshift's kernels unless `weights` is [`CpuWeights::F32`] ([`Layout::Stored16`](super::Layout::Stored16)):
/// the same weights as widened to f32, in half the memory, each product's sums in the kernels' order.
pub fn load(dir: &Path, device: &Device, dtype: Option<DType>, weights: CpuWeights, slice: Option<&RankSlice>, shared: Option<&Embedding>) -> Result<(Model, ModelInfo), ModelError> {
    let Checkpoint { info, variant, shards } = Checkpoint::open(dir)?;
    let mut config = info.config.clone();
    let whole = RankSlice::whole(info.config.heads, info.config.kv_heads);
    let slice = slice.unwrap_or(&whole);
    if variant.qk_norm_rows && slice.ranks > 1 {
        return Err(ModelError::Metadata(format!("{}'s q/k norms take whole q and k rows: they are not split over ranks (runtime.tensor_parallel = 1)", config.architecture)));
    }
    let (hd, rot) = (config.head_dim, config.rotary_dim);
    let dtype = match dtype {
        Some(dtype) => dtype,
        None => compute_dtype(device, ComputeDtype::Auto),
    };
    let load = |name: &str| shards.load(name, device, dtype);
    // A matrix's tensor: in its stored 16-bit dtype where it goes to the CPU kernels as stored, in `dtype` otherwise.
    let sixteen = device.is_cpu() && dtype == DType::F32 && weights != CpuWeights::F32;
    let load_matrix = |name: &str| match shards.stored_dtype(name) {
        Some(stored @ (DType::BF16 | DType::F16)) if sixteen => shards.load(name, device, stored),
        _ => load(name),
    };
    let rotary = |name: &str| load(name).and_then(|t| interleave_halves(&t, hd, rot).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}"))));
    let rotary_matrix = |name: &str| load_matrix(name).and_then(|t| interleave_halves(&t, hd, rot).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}"))));
    // A norm weight: Gemma's `w` as `1 + w`, added in f32 before the compute dtype, as Hugging Face computes it.
    let norm = |name: &str| -> Result<Tensor, ModelError> {
        match variant.post_norms {
            true => shards
                .load(name, device, DType::F32)
                .and_then(|w| w.affine(1.0, 1.0).and_then(|w| w.to_dtype(dtype)).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}")))),
            false => load(name),
        }
    };
    let mut post_norms = Vec::new();
    // The matrix of a tensor: a 16-bit one packed for the kernels, in `dtype` for candle otherwise (a 16-bit tensor
    // the kernels cannot take, widened).
    let stored16 = std::cell::Cell::new(None);
    let dense = |t: Tensor| -> Result<Matrix, ModelError> {
        let fail = |e: candle_core::Error| ModelError::Metadata(format!("a matrix of shape {:?}: {e}", t.dims()));
        if t.dtype() != dtype {
            if let Some(m) = Matrix::packed_16bit(&t).map_err(fail)? {
                stored16.set(Some(t.dtype()));
                return Ok(m);
            }
        }
        Ok(Matrix::Candle(QMatMul::Tensor(t.to_dtype(dtype).map_err(fail)?)))
    };
    // This rank's rows (`Rows`) or columns of a tensor: by query heads, kv heads or feed-forward columns.
    let tp = slice.ranks > 1;
    let (heads, kv_heads) = (slice.heads.start * hd..slice.heads.end * hd, slice.kv_heads.start * hd..slice.kv_heads.end * hd);
    let cut = |t: Tensor, columns: bool, range: std::ops::Range<usize>| -> Result<Tensor, ModelError> {
        if !tp {
            return Ok(t);
        }
        match columns {
            true => RankSlice::columns_t(&t, range),
            false => RankSlice::rows_t(&t, range),
        }
        .map_err(|e| ModelError::Metadata(format!("tensor parallelism: {e}")))
    };
    // A gated network of `width` columns, this rank's part.
    let ffn = |gate: Tensor, up: Tensor, down: Tensor, width: usize| -> Result<[Matrix; 3], ModelError> {
        let part = slice.ffn(width);
        Ok([dense(cut(gate, false, part.clone())?)?, dense(cut(up, false, part.clone())?)?, dense(cut(down, true, part)?)?])
    };
    // On the CPU a 16-bit table stays in 16 bits, its rows widened when looked up ([`Embedding`]); tied to the
    // output projection, it is held once, as that matrix in the kernels' layout ([`Embedding::Packed`]).
    let mut tied_head = None;
    let embedding = match shared {
        Some(table) if slice.rank > 0 => table.clone(),
        _ => match load_matrix("model.embed_tokens.weight")? {
            t if t.dtype() != dtype && variant.tied && slice.rank == 0 => match dense(t.clone())? {
                Matrix::Packed(p) => {
                    tied_head = Some(Matrix::Packed(p.clone()));
                    Embedding::Packed { width: p.columns(), matrix: p }
                }
                other => {
                    tied_head = Some(other);
                    Embedding::Sixteen(t)
                }
            },
            t if t.dtype() != dtype => Embedding::Sixteen(t),
            t => Embedding::Dense(t),
        },
    };
    let mut layers = Vec::with_capacity(config.layers);
    for i in 0..config.layers {
        let p = |suffix: &str| format!("model.layers.{i}.{suffix}");
        let qkv_bias = match variant.qkv_bias {
            true => Some([
                cut(rotary(&p("self_attn.q_proj.bias"))?, false, heads.clone())?,
                cut(rotary(&p("self_attn.k_proj.bias"))?, false, kv_heads.clone())?,
                cut(load(&p("self_attn.v_proj.bias"))?, false, kv_heads.clone())?,
            ]),
            false => None,
        };
        let head_norm = |name: &str| norm(name).and_then(|t| interleave_halves(&t, hd, rot).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}"))));
        let qk_norm = match variant.qk_norm {
            true => Some([head_norm(&p("self_attn.q_norm.weight"))?, head_norm(&p("self_attn.k_norm.weight"))?]),
            false => None,
        };
        // Gemma's `post_attention_layernorm` follows attention; its norm before the feed-forward network is
        // `pre_feedforward_layernorm` (llama's `post_attention_layernorm`).
        let ffn_norm = match variant.post_norms {
            true => {
                post_norms.push(PostNorms { attn: norm(&p("post_attention_layernorm.weight"))?.into(), ffn: norm(&p("post_feedforward_layernorm.weight"))?.into() });
                norm(&p("pre_feedforward_layernorm.weight"))?
            }
            false => load(&p("post_attention_layernorm.weight"))?,
        };
        // Phi-3's fused matrices, split by rows (q, k, v; gate, up).
        let rows = |name: &str, parts: &[usize]| -> Result<Vec<Tensor>, ModelError> {
            let t = load_matrix(name)?;
            let mut at = 0;
            parts
                .iter()
                .map(|&n| {
                    at += n;
                    t.narrow(0, at - n, n).and_then(|r| r.contiguous()).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}")))
                })
                .collect()
        };
        let halves = |t: Tensor, name: &str| interleave_halves(&t, hd, rot).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}")));
        let (q_rows, kv_rows) = (config.heads * hd, config.kv_heads * hd);
        let (wq, wk, wv) = match variant.fused {
            true => {
                let qkv = p("self_attn.qkv_proj.weight");
                let [q, k, v]: [Tensor; 3] = rows(&qkv, &[q_rows, kv_rows, kv_rows])?.try_into().expect("three parts");
                (halves(q, &qkv)?, halves(k, &qkv)?, v)
            }
            false => (rotary_matrix(&p("self_attn.q_proj.weight"))?, rotary_matrix(&p("self_attn.k_proj.weight"))?, load_matrix(&p("self_attn.v_proj.weight"))?),
        };
        let ffn = match (variant.experts, &config.moe) {
            (Some(names), Some(moe)) => {
                let experts = (0..moe.experts)
                    .map(|e| {
                        let [gate, up, down] = names.expert(e).map(|n| p(&n));
                        let [gate, up, down] = ffn(load_matrix(&gate)?, load_matrix(&up)?, load_matrix(&down)?, config.ffn_size)?;
                        Ok(Expert { gate, up, down })
                    })
                    .collect::<Result<_, ModelError>>()?;
                let name = p(names.router());
                let router = Router::new(shards.load(&name, device, DType::F32)?).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}")))?;
                let experts = Experts::new(router, experts, moe);
                match moe.shared {
                    None => Ffn::Experts(Box::new(experts)),
                    Some(width) => {
                        let [gate, up, down] = ["gate_proj", "up_proj", "down_proj"].map(|w| p(&format!("mlp.shared_expert.{w}.weight")));
                        let [gate, up, down] = ffn(load_matrix(&gate)?, load_matrix(&up)?, load_matrix(&down)?, width)?;
                        let expert = Expert { gate, up, down };
                        let name = p("mlp.shared_expert_gate.weight");
                        let experts = experts.with_shared(expert, shards.load(&name, device, DType::F32)?).map_err(|e| ModelError::Metadata(format!("tensor `{name}`: {e}")))?;
                        Ffn::Experts(Box::new(experts))
                    }
                }
            }
            _ if variant.fused => {
                let gate_up = p("mlp.gate_up_proj.weight");
                let [gate, up]: [Tensor; 2] = rows(&gate_up, &[config.ffn_size, config.ffn_size])?.try_into().expect("two parts");
                let [gate, up, down] = ffn(gate, up, load_matrix(&p("mlp.down_proj.weight"))?, config.ffn_size)?;
                Ffn::Dense { gate, up, down }
            }
            _ => {
                let [gate, up, down] = ffn(load_matrix(&p("mlp.gate_proj.weight"))?, load_matrix(&p("mlp.up_proj.weight"))?, load_matrix(&p("mlp.down_proj.weight"))?, config.ffn_size)?;
                Ffn::Dense { gate, up, down }
            }
        };
        layers.push(Layer {
            attn_norm: norm(&p("input_layernorm.weight"))?.into(),
            wq: dense(cut(wq, false, heads.clone())?)?,
            wk: dense(cut(wk, false, kv_heads.clone())?)?,
            wv: dense(cut(wv, false, kv_heads.clone())?)?,
            wo: dense(cut(load_matrix(&p("self_attn.o_proj.weight"))?, true, heads.clone())?)?,
            qkv_bias: vectors(qkv_bias),
            wo_bias: if variant.wo_bias { Some(load(&p("self_attn.o_proj.bias"))?.into()) } else { None },
            qk_norm: vectors(qk_norm),
            ffn_norm: ffn_norm.into(),
            ffn,
        });
    }
    let output_norm = norm("model.norm.weight")?;
    // A tensor-parallel model's logits are its first rank's alone.
    let lm_head = match (slice.rank == 0, variant.tied) {
        (false, _) => None,
        // Tied: the embedding's tensor (16-bit as stored on the CPU), packed as the other matrices are held.
        (true, true) if tied_head.is_some() => tied_head.take(),
        (true, true) => Some(dense(embedding.tensor().cloned().ok_or_else(|| ModelError::Metadata("a tied embedding table not held as a tensor (a bug)".into()))?)?),
        (true, false) => Some(dense(load_matrix("lm_head.weight")?)?),
    };
    if tp {
        config.ffn_size = slice.ffn(config.ffn_size).len();
        (config.heads, config.kv_heads) = (slice.heads.len(), slice.kv_heads.len());
    }
    let layout = match stored16.get() {
        Some(DType::F16) => super::Layout::Stored16(candle_core::quantized::GgmlDType::F16),
        Some(_) => super::Layout::Stored16(candle_core::quantized::GgmlDType::BF16),
        None => super::Layout::AsStored,
    };
    let weights = Weights { embedding, layers, post_norms, output_norm, lm_head, attn_width: config.heads * hd, layout };
    Ok((Model::assemble(config, device, weights), info))
}

/// Within a head of `head_dim` rows, the row each row takes when Hugging Face's rotate-half pairing of the first
/// `rotary_dim` values (pairs `(i, i + rotary_dim / 2)`) becomes adjacent pairs: row `2i` takes row `i` and row
/// `2i + 1` row `i + rotary_dim / 2`; the rows from `rotary_dim` on (partial rotary: not rotated) stay in place.
pub(crate) fn rotary_row_order(head_dim: usize, rotary_dim: usize) -> Vec<usize> {
    let half = rotary_dim / 2;
    (0..half).flat_map(|i| [i, i + half]).chain(rotary_dim..head_dim).collect()
}

/// Reorders the rows of a tensor whose first dimension is `heads x head_dim` (a q or k projection, its bias, a
/// per-head norm weight) within each head, from Hugging Face's rotate-half pairing to adjacent pairs
/// ([`rotary_row_order`]).
pub(crate) fn interleave_halves(t: &Tensor, head_dim: usize, rotary_dim: usize) -> candle_core::Result<Tensor> {
    let rows = t.dim(0)?;
    if head_dim == 0 || !rows.is_multiple_of(head_dim) || rotary_dim > head_dim || !rotary_dim.is_multiple_of(2) {
        candle_core::bail!("{rows} rows are not whole heads of {head_dim} with {rotary_dim} rotated");
    }
    let order = rotary_row_order(head_dim, rotary_dim);
    let index: Vec<u32> = (0..rows / head_dim).flat_map(|h| order.iter().map(move |&r| (h * head_dim + r) as u32)).collect();
    t.index_select(&Tensor::from_vec(index, rows, t.device())?, 0)
}

/// A special token as tokenizer_config.json writes it: a string, `{"content": ...}`, or null.
fn token_text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

/// Token ids as config files write them: one id, a list, or null.
fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|id| id as u32).into_iter().collect(),
        Some(Value::Array(ids)) => ids.iter().filter_map(Value::as_u64).map(|id| id as u32).collect(),
        _ => Vec::new(),
    }
}

/// The chat template: `chat_template.jinja` when present (newer exports), else tokenizer_config.json's
/// `chat_template`, a string or a list of named templates (the one named `default`, or the first).
fn chat_template(dir: &Path, tokenizer_config: Option<&Value>) -> Result<Option<String>, ModelError> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(text) => return Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(ModelError::Open { path: jinja, source }),
    }
    Ok(match tokenizer_config.and_then(|t| t.get("chat_template")) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(named)) => {
            let template = |t: &Value| t.get("template").and_then(Value::as_str).map(String::from);
            named.iter().find(|t| t.get("name").and_then(Value::as_str) == Some("default")).or(named.first()).and_then(template)
        }
        _ => None,
    })
}

/// The tokenizer and its special tokens. BOS is tokenizer_config.json's `bos_token` (config.json's
/// `bos_token_id` when the key is absent), added when `add_bos_token` says so or, without that key, when
/// tokenizer.json's post-processor adds it. End tokens: tokenizer_config.json's `eos_token` (the chat template's
/// EOS), then generation_config.json's and config.json's `eos_token_id`s (one or a list); the first two become
/// `eos` and `eot`, the rest `more_ends`. Added special tokens are control tokens, so the stop rules also see the usual end-of-turn
/// tokens.
fn vocab(dir: &Path, config: &HfConfig, vocab_size: usize) -> Result<VocabMetadata, ModelError> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Err(ModelError::Open { path, source: std::io::ErrorKind::NotFound.into() });
    }
    let mut tokenizer =
        crate::tokenize::vocab::from_file(&path).map_err(|message| ModelError::File { path: path.clone(), message })?;
    tokenizer.with_padding(None);
    tokenizer.with_truncation(None).map_err(|e| ModelError::Metadata(format!("`{}`: {e}", path.display())))?;
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?;
    let generation_config = read_json(&dir.join("generation_config.json"))?;
    let special = |key: &str| tokenizer_config.as_ref().and_then(|t| token_text(t.get(key))).and_then(|s| tokenizer.token_to_id(&s));

    let bos = match tokenizer_config.as_ref().is_some_and(|t| t.get("bos_token").is_some()) {
        true => special("bos_token"),
        false => token_ids(config.bos_token_id.as_ref()).first().copied(),
    };
    let add_bos = match tokenizer_config.as_ref().and_then(|t| t.get("add_bos_token")).and_then(Value::as_bool) {
        Some(add) => add,
        None => bos.is_some_and(|bos| {
            let with = tokenizer.encode_fast("a", true).map(|e| e.get_ids().first().copied());
            let without = tokenizer.encode_fast("a", false).map(|e| e.get_ids().first().copied());
            matches!((with, without), (Ok(Some(first)), Ok(w)) if first == bos && w != Some(bos))
        }),
    };
    let mut ends: Vec<u32> = special("eos_token").into_iter().collect();
    let generation_ends = token_ids(generation_config.as_ref().and_then(|g| g.get("eos_token_id")));
    for id in generation_ends.into_iter().chain(token_ids(config.eos_token_id.as_ref())) {
        if !ends.contains(&id) {
            ends.push(id);
        }
    }

    let ids = tokenizer.get_vocab(true);
    let size = ids.values().max().map_or(0, |&m| m as usize + 1);
    if size > vocab_size {
        return Err(ModelError::Metadata(format!(
            "tokenizer.json has token id {}, outside the model's vocabulary of {vocab_size}",
            size - 1
        )));
    }
    let mut tokens = vec![String::new(); size];
    for (token, id) in ids {
        tokens[id as usize] = token;
    }
    let mut token_types = vec![1; size];
    for (id, added) in tokenizer.get_added_tokens_decoder() {
        if let Some(t) = token_types.get_mut(id as usize) {
            *t = if added.special { TOKEN_TYPE_CONTROL } else { TOKEN_TYPE_USER_DEFINED };
        }
    }
    use tokenizers::ModelWrapper;
    let kind = match tokenizer.get_model() {
        ModelWrapper::BPE(_) => "bpe",
        ModelWrapper::WordPiece(_) => "wordpiece",
        ModelWrapper::WordLevel(_) => "wordlevel",
        ModelWrapper::Unigram(_) => "unigram",
    };
    Ok(VocabMetadata {
        kind: kind.into(),
        pre: Some("tokenizer.json".into()),
        tokens,
        token_types,
        merges: Vec::new(),
        bos,
        eos: ends.first().copied(),
        eot: ends.get(1).copied(),
        more_ends: ends.iter().skip(2).copied().collect(),
        add_bos,
        add_eos: false,
        chat_template: chat_template(dir, tokenizer_config.as_ref())?,
        tokenizer: Some(std::sync::Arc::new(tokenizer)),
        gguf: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: Value) -> Result<(ModelConfig, Variant), ModelError> {
        let hf: HfConfig = serde_json::from_value(json).map_err(|e| invalid(e.to_string()))?;
        model_config(&hf, Path::new("tiny"))
    }

    fn base() -> Value {
        serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 300
        })
    }

    fn with(key: &str, value: Value) -> Value {
        let mut c = base();
        c[key] = value;
        c
    }

    /// Gemma's and Phi-3's keys as Hugging Face reads them: Gemma 3's sliding layers from `sliding_window_pattern`
    /// (every sixth global) or `layer_types`, its local RoPE base; Gemma 2's every other layer; Phi-3's window over
    /// every layer, none when as long as the context; the activations each family must name.
    #[test]
    fn gemma_and_phi3_keys_follow_hugging_face() {
        let gemma = |model_type: &str, extra: &[(&str, Value)]| {
            let mut c = base();
            c["model_type"] = model_type.into();
            c["num_hidden_layers"] = 12.into();
            c["hidden_activation"] = "gelu_pytorch_tanh".into();
            c["sliding_window"] = 32.into();
            for (k, v) in extra {
                c[*k] = v.clone();
            }
            config(c)
        };
        let (c, v) = gemma("gemma3_text", &[("rope_local_base_freq", 10000.0.into()), ("rope_theta", 1e6.into())]).unwrap();
        let s = c.sliding.unwrap();
        assert_eq!((s.window, s.rope_base), (32, 10_000.0));
        assert_eq!((0..12).filter(|&l| !s.layers[l]).collect::<Vec<_>>(), [5, 11]);
        assert!(v.tied && v.qk_norm && v.post_norms && c.gemma.is_some());
        let types: Vec<Value> = (0..12).map(|l| if l % 3 == 2 { "full_attention" } else { "sliding_attention" }.into()).collect();
        let (c, _) = gemma("gemma3_text", &[("layer_types", Value::Array(types))]).unwrap();
        assert_eq!((0..12).filter(|&l| !c.sliding.as_ref().unwrap().layers[l]).collect::<Vec<_>>(), [2, 5, 8, 11]);
        let (c, v) = gemma("gemma2", &[("attn_logit_softcapping", 50.0.into()), ("final_logit_softcapping", 30.0.into())]).unwrap();
        assert_eq!(c.sliding.unwrap().layers[..3], [true, false, true]);
        assert_eq!(c.gemma.as_ref().map(|g| (g.attn_softcap, g.final_softcap)), Some((Some(50.0), Some(30.0))));
        assert!(!v.qk_norm);
        let e = gemma("gemma2", &[("hidden_activation", "silu".into())]).unwrap_err().to_string();
        assert!(e.contains("hidden_activation `silu`"), "{e}");
        let phi3 = |window: usize| {
            let mut c = with("model_type", "phi3".into());
            c["sliding_window"] = window.into();
            config(c).unwrap()
        };
        let (c, v) = phi3(64);
        assert!(v.fused && c.sliding.as_ref().is_some_and(|s| s.window == 64 && s.layers.iter().all(|&l| l)));
        assert!(phi3(256).0.sliding.is_none(), "a window as long as the context is none");
        // Phi-4-mini's partial rotary: 3/4 of each head (12 of 16 here); factors that leave an odd count, or none, refused.
        let mut partial = with("model_type", "phi3".into());
        partial["partial_rotary_factor"] = 0.75.into();
        let (c, _) = config(partial.clone()).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (16, 12));
        assert!(c.partial_rotary().is_some_and(|l| l.contains("12 of each head's 16")));
        for bad in [0.7, 0.0, 1.5] {
            partial["partial_rotary_factor"] = bad.into();
            assert!(config(partial.clone()).unwrap_err().to_string().contains("partial_rotary_factor"), "{bad}");
        }
        assert_eq!(config(base()).unwrap().0.rotary_dim, 16);
    }

    #[test]
    fn interleaving_halves_turns_rotate_half_rope_into_adjacent_pair_rope() {
        let (hd, half, heads) = (8usize, 4usize, 2usize);
        let x: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..half).map(|i| ((i as f32 + 1.0).cos(), (i as f32 + 1.0).sin())).unzip();
        // Rotate half, as Hugging Face does: pairs (i, i + half).
        let mut reference = x.clone();
        for h in 0..heads {
            for i in 0..half {
                let (a, b) = (x[h * hd + i], x[h * hd + i + half]);
                reference[h * hd + i] = a * cos[i] - b * sin[i];
                reference[h * hd + i + half] = a * sin[i] + b * cos[i];
            }
        }
        let permuted = interleave_halves(&Tensor::from_vec(x, heads * hd, &Device::Cpu).unwrap(), hd, hd).unwrap();
        let mut adjacent = permuted.to_vec1::<f32>().unwrap();
        for h in 0..heads {
            for i in 0..half {
                let (a, b) = (adjacent[h * hd + 2 * i], adjacent[h * hd + 2 * i + 1]);
                adjacent[h * hd + 2 * i] = a * cos[i] - b * sin[i];
                adjacent[h * hd + 2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
        let back = interleave_halves(&Tensor::from_vec(reference, heads * hd, &Device::Cpu).unwrap(), hd, hd).unwrap();
        assert_eq!(adjacent, back.to_vec1::<f32>().unwrap());
        // Partial rotary: the first 4 of 8 rotate (pairs (0, 2) and (1, 3)), the last 4 stay where they are.
        assert_eq!(rotary_row_order(8, 4), [0, 2, 1, 3, 4, 5, 6, 7]);
        assert_eq!(rotary_row_order(8, 8), [0, 4, 1, 5, 2, 6, 3, 7]);
        let rows = Tensor::arange(0u32, 16, &Device::Cpu).unwrap();
        assert_eq!(interleave_halves(&rows, 8, 4).unwrap().to_vec1::<u32>().unwrap(), [0, 2, 1, 3, 4, 5, 6, 7, 8, 10, 9, 11, 12, 13, 14, 15]);
        assert!(interleave_halves(&rows, 6, 4).is_err() && interleave_halves(&rows, 8, 3).is_err());
    }

    #[test]
    fn variants_follow_model_type_and_flags() {
        let (c, v) = config(base()).unwrap();
        assert_eq!((c.architecture.as_str(), c.head_dim, v.qkv_bias, v.qk_norm, v.tied), ("llama", 16, false, false, false));
        let (_, v) = config(with("model_type", "qwen2".into())).unwrap();
        assert!(v.qkv_bias && !v.wo_bias);
        let mut qwen3 = with("model_type", "qwen3".into());
        qwen3["head_dim"] = 32.into();
        qwen3["tie_word_embeddings"] = true.into();
        let (c, v) = config(qwen3).unwrap();
        assert!(v.qk_norm && v.tied && c.head_dim == 32);
        let mut classes = base();
        classes.as_object_mut().unwrap().remove("model_type");
        classes["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        classes["sliding_window"] = 128.into();
        let (c, _) = config(classes.clone()).unwrap();
        assert_eq!((c.architecture.as_str(), c.context_length), ("mistral", base()["max_position_embeddings"].as_u64().unwrap() as usize), "the whole context");
        let sliding = c.sliding.expect("Mistral's window slides in every layer");
        assert_eq!((sliding.window, sliding.layers.len(), sliding.layers.iter().all(|&l| l)), (128, c.layers, true));
        // Qwen's window (only where `use_sliding_window` says) caps the context.
        classes["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        classes["use_sliding_window"] = true.into();
        let (c, _) = config(classes).unwrap();
        assert_eq!((c.architecture.as_str(), c.context_length, c.sliding.is_none()), ("qwen2", 128, true), "the context is capped at the window");
    }

    #[test]
    fn bad_config_values_are_errors_that_name_the_key() {
        let cases = [
            (with("model_type", "gemma".into()), "gemma"),
            (with("num_attention_heads", 3.into()), "heads"),
            (with("num_hidden_layers", 0.into()), "num_hidden_layers"),
            (with("vocab_size", (1u64 << 40).into()), "vocab_size"),
            (with("max_position_embeddings", (1u64 << 30).into()), "max_position_embeddings"),
            (with("head_dim", 7.into()), "head size 7"),
            (with("hidden_act", "gelu".into()), "hidden_act"),
            (with("rms_norm_eps", (-1.0).into()), "rms_norm_eps"),
            (with("rope_scaling", serde_json::json!({"rope_type": "yarn", "factor": 4.0})), "yarn"),
            (with("rope_scaling", serde_json::json!({"rope_type": "llama3", "factor": 8.0})), "low_freq_factor"),
            (with("hidden_size", "wide".into()), "invalid type"),
            (with("model_type", "qwen3".into()), "head_dim"),
        ];
        for (json, needle) in cases {
            let e = config(json).unwrap_err().to_string();
            assert!(e.contains(needle), "{e:?} does not mention {needle:?}");
        }
    }
}
