//! The tests' tiny random-weight models, written by `nightshift::synth`: a llama GGUF and Hugging Face directories
//! of every decoder family. Their outputs are noise, but deterministic: the same files on every run and machine.

use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use nightshift::synth::{self, Family, Init, Llama3Rope, MoeShape, Shape, Spec, Vocabulary};

/// The tiny models' tokenizer: GPT-2's 256 byte tokens, three merges (`Ġt`, `he` and `Ġa`: ids 256 to 258), then
/// `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` as control tokens (ids 259 to 261). synth's chat template is
/// ChatML.
const VOCABULARY: Vocabulary = Vocabulary { merges: &["Ġ t", "h e", "Ġ a"], size: 262, add_bos: false };

/// A tiny llama model written as GGUF (Q8_0 matrices, the layout the real model runs in) with the tiny
/// vocabulary: hidden size 64, 2 layers, 4 heads, 2 kv heads, context 256. Fast for tests of batching, commits
/// and resuming, which compare a job with itself.
///
/// The seed is one of the first eighty tried whose greedy outputs vary as the reliability tests want: on their
/// prompts, about one row in six ends at an end token, at various lengths before `max_new_tokens`, so an
/// interrupted job is compared with an uninterrupted one on rows of both finish reasons and of different lengths.
/// (Many seeds end no row early, or nearly all.)
pub fn write_tiny_model(path: &Path) {
    let shape = Shape {
        name: "tiny-gguf",
        family: Family::Llama,
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        intermediate: 128,
        vocab: VOCABULARY.size,
        context: 256,
        rope_theta: 10000,
        rope_scaling: None,
        tied: false,
        sliding_window: None,
        moe: None,
        rotary_dim: None,
    };
    let spec = Spec { shape, vocabulary: VOCABULARY, dtype: DType::F32, init: Init::Peaked, seed: 0xf };
    synth::write_gguf(path, &spec, GgmlDType::Q8_0).unwrap();
}

/// The decoder variants of Hugging Face directories the tests write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfVariant {
    /// `llama` with Llama 3's RoPE scaling, a BOS the tokenizer adds, and a separate output projection; f32.
    Llama3,
    /// `llama` with tied embeddings, as SmolLM; bf16.
    SmolLm,
    /// `mistral` with `head_dim` (48) wider than hidden / heads (32), and a sliding window as long as the context;
    /// f16.
    Mistral,
    /// `qwen2`: q, k and v biases, tied embeddings, a vocabulary larger than the tokenizer's; f32.
    Qwen2,
    /// `qwen3`: per-head q and k RMSNorm, `head_dim` 40, tied embeddings; bf16.
    Qwen3,
    /// `gemma2`: post-norms, GeGLU, soft-caps, layer 0 of 2 sliding over 16 positions; f32.
    Gemma2,
    /// `gemma3_text`: `head_dim` 40, q/k norms, layers 0 to 4 of 6 sliding over 16 positions with a RoPE base of
    /// 10,000 (the global layer's 1,000,000); bf16.
    Gemma3,
    /// `phi3`: fused `qkv_proj` and `gate_up_proj`, no window (candle-transformers' Phi-3, the reference, has none);
    /// f32.
    Phi3,
    /// `phi3` as Phi-4-mini: RoPE on 24 of each head's 32 values (`partial_rotary_factor` 0.75), tied embeddings; f32.
    Phi4Mini,
    /// `mixtral`: 8 experts of 128, 2 per token, their weights renormalized; f32.
    Mixtral,
    /// `qwen3_moe`: q/k norms, `head_dim` 40, 16 experts of 64, 4 per token, `norm_topk_prob`; bf16.
    Qwen3Moe,
    /// `qwen2_moe`: q, k and v biases, 8 experts of 64, 2 per token, not renormalized, a shared expert of 128 gated
    /// by a sigmoid; f32.
    Qwen2Moe,
}

impl HfVariant {
    pub const ALL: [HfVariant; 12] = [
        HfVariant::Llama3,
        HfVariant::SmolLm,
        HfVariant::Mistral,
        HfVariant::Qwen2,
        HfVariant::Qwen3,
        HfVariant::Gemma2,
        HfVariant::Gemma3,
        HfVariant::Phi3,
        HfVariant::Phi4Mini,
        HfVariant::Mixtral,
        HfVariant::Qwen3Moe,
        HfVariant::Qwen2Moe,
    ];
}

/// Writes a tiny Hugging Face decoder directory of one variant, with the tiny vocabulary: hidden size 128, 2 layers,
/// 4 heads, 2 kv heads, context 512, every matrix at least 64 wide, as in real models (candle's f32 matmul takes
/// other kernels for narrower outputs). Weights as [`Init::Peaked`] draws them, so that a norm weight or bias an
/// implementation drops shows in its logits.
///
/// The end tokens are named as real directories name them, for the loader to read: tokenizer_config.json's
/// `eos_token` as an added-token object, and generation_config.json's list of end tokens (`<|im_end|>`, then
/// `<|endoftext|>`, as Qwen's lists them).
/// The tiny shape with an 8,192-position context, f32 Hugging Face safetensors: long prompts at little cost.
pub fn write_long_context_model(dir: &Path) {
    let tiny = Shape::named("tiny").unwrap();
    let shape = Shape { name: "tiny-8k", vocab: VOCABULARY.size, context: 8192, rope_theta: 100000, ..tiny };
    let spec = Spec { shape, vocabulary: VOCABULARY, dtype: DType::F32, init: Init::Peaked, seed: 0x8192 };
    synth::write_hf(dir, &spec).unwrap();
}

pub fn write_tiny_hf_model(dir: &Path, variant: HfVariant) {
    // synth's "tiny" shape with the tests' vocabulary.
    let tiny = Shape::named("tiny").unwrap();
    let base = Shape { name: "tiny-hf", vocab: VOCABULARY.size, context: 512, rope_theta: 10000, tied: false, ..tiny };
    let (shape, dtype) = match variant {
        // Wavelengths from 6 to 6e5 positions: some kept (< 16), some stretched (> 64), some interpolated.
        HfVariant::Llama3 => {
            let rope_scaling = Some(Llama3Rope { factor: 8, original_context: 64 });
            (Shape { rope_theta: 500000, rope_scaling, ..base }, DType::F32)
        }
        HfVariant::SmolLm => (Shape { rope_theta: 100000, tied: true, ..base }, DType::BF16),
        HfVariant::Mistral => (Shape { family: Family::Mistral, head_dim: 48, ..base }, DType::F16),
        HfVariant::Qwen2 => (Shape { family: Family::Qwen2, vocab: VOCABULARY.size + 26, tied: true, ..base }, DType::F32),
        HfVariant::Qwen3 => (Shape { family: Family::Qwen3, head_dim: 40, tied: true, ..base }, DType::BF16),
        HfVariant::Gemma2 => (Shape { family: Family::Gemma2, tied: true, sliding_window: Some(16), ..base }, DType::F32),
        HfVariant::Phi3 => (Shape { family: Family::Phi3, ..base }, DType::F32),
        HfVariant::Phi4Mini => (Shape { family: Family::Phi3, tied: true, rotary_dim: Some(base.head_dim * 3 / 4), ..base }, DType::F32),
        HfVariant::Mixtral => (Shape { family: Family::Mixtral, moe: Some(MoeShape { experts: 8, used: 2, intermediate: 128, shared: None }), ..base }, DType::F32),
        HfVariant::Qwen3Moe => {
            (Shape { family: Family::Qwen3Moe, head_dim: 40, moe: Some(MoeShape { experts: 16, used: 4, intermediate: 64, shared: None }), ..base }, DType::BF16)
        }
        HfVariant::Qwen2Moe => {
            (Shape { family: Family::Qwen2Moe, moe: Some(MoeShape { experts: 8, used: 2, intermediate: 64, shared: Some(128) }), ..base }, DType::F32)
        }
        HfVariant::Gemma3 => {
            (Shape { family: Family::Gemma3, layers: 6, head_dim: 40, tied: true, sliding_window: Some(16), rope_theta: 1_000_000, ..base }, DType::BF16)
        }
    };
    let vocabulary = Vocabulary { add_bos: variant == HfVariant::Llama3, ..VOCABULARY };
    let spec = Spec { shape, vocabulary, dtype, init: Init::Peaked, seed: 0x5eed_0000 + variant as u64 };
    synth::write_hf(dir, &spec).unwrap();

    let path = dir.join("tokenizer_config.json");
    let mut tokenizer_config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tokenizer_config["eos_token"] = serde_json::json!({"content": "<|im_end|>", "special": true});
    std::fs::write(&path, serde_json::to_string_pretty(&tokenizer_config).unwrap()).unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [261, 259]}"#).unwrap();
}
