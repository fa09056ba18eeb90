//! `nightshift synth-model`: a random-weight llama-family model of a real model's shape, written as a Hugging Face
//! directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).
//!
//! The GPU host cannot receive real weights, but throughput and memory depend only on shapes: a random
//! Llama-3.2-1B runs exactly the kernels, bytes and FLOPs of the real one. The same directory loads in nightshift
//! and in Hugging Face transformers, so both engines run the same weights. Its text is noise.
//!
//! The tokenizer is byte-level BPE with GPT-2's 256 byte tokens, ChatML's special tokens, and filler tokens up to
//! the vocabulary size (reachable only by sampling, never by tokenizing): prompts tokenize to one token per byte,
//! which is what a synthetic workload needs.
//!
//! [`synth_gguf`] writes the same weights as a quantized GGUF file beside them (`--gguf q4_1`), for the GGUF path's
//! kernels on hosts that cannot receive a real GGUF: q and k rows permuted as llama.cpp's converter does for its
//! adjacent-pair RoPE, the tokenizer in GGUF metadata. (Llama 3's RoPE scaling is left out: GGUF carries it as a
//! `rope_freqs` tensor, which nightshift's GGUF loader does not read, so such a file runs plain RoPE.)
//!
//! The tests' tiny models come from here too, through a [`Spec`]: the other families nightshift loads (mistral,
//! qwen2 with its biases, qwen3 with its q/k norms), a vocabulary with merges, and weights drawn so that every one
//! of them shows in the logits ([`Init::Peaked`]), written as a directory ([`write_hf`]) or one GGUF file
//! ([`write_gguf`]).

pub mod t5;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use crate::error::Error;
use crate::tokenize::VocabMetadata;

/// A checkpoint family: Hugging Face's `model_type`, and what each adds to llama's layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Llama 2 and 3, SmolLM.
    Llama,
    /// Llama's layers and a sliding window, written as long as the context (full attention).
    Mistral,
    /// Biases on q, k and v; a sliding window, off.
    Qwen2,
    /// Per-head RMSNorm of q and k before RoPE; a sliding window, off.
    Qwen3,
    /// Gemma 2: norms after attention and the feed-forward network too (stored as `w` for `1 + w`), GeGLU,
    /// embeddings scaled by sqrt(hidden), every other layer sliding, attention and final soft-caps of 50 and 30.
    Gemma2,
    /// Gemma 3 (text): Gemma 2's layers with per-head q/k norms instead of attention soft-capping, five sliding
    /// layers to a global one, local layers' RoPE base 10,000.
    Gemma3,
    /// Phi-3: llama's layers with q, k and v in one matrix (`qkv_proj`) and gate and up in one (`gate_up_proj`), a
    /// sliding window over every layer.
    Phi3,
    /// Mixtral: Mistral's layers with a mixture of SwiGLU experts (`block_sparse_moe`), their weights renormalized.
    Mixtral,
    /// Qwen3-MoE: Qwen3's layers with a mixture of experts (`mlp.experts`), `norm_topk_prob` on.
    Qwen3Moe,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's layers (q, k and v biases) with a mixture of experts,
    /// `norm_topk_prob` off, and a shared expert every token computes, gated by a sigmoid (`mlp.shared_expert`).
    Qwen2Moe,
    /// OLMoE (allenai/OLMoE-1B-7B): RMSNorms of the whole q and k rows (not per head) before RoPE, and a mixture of
    /// experts as Qwen3-MoE's with `norm_topk_prob` off.
    Olmoe,
}

impl Family {
    fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3_text",
            Family::Phi3 => "phi3",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Olmoe => "olmoe",
        }
    }

    /// Gemma's, whose RMSNorm weights are stored as `w` for `1 + w`.
    pub fn is_gemma(self) -> bool {
        matches!(self, Family::Gemma2 | Family::Gemma3)
    }

    /// Whether the family has q, k and v biases (Qwen2's).
    fn qkv_bias(self) -> bool {
        matches!(self, Family::Qwen2 | Family::Qwen2Moe)
    }

    /// Whether the family has q/k norms (per head, or over the whole row: [`Family::qk_norm_rows`]).
    fn qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3 | Family::Olmoe)
    }

    /// Whether its q/k norms take the whole q and k rows (OLMoE's), not each head.
    pub fn qk_norm_rows(self) -> bool {
        self == Family::Olmoe
    }

    fn class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Gemma2 => "Gemma2ForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
            Family::Phi3 => "Phi3ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
            Family::Olmoe => "OlmoeForCausalLM",
        }
    }
}

/// Llama 3's RoPE scaling (`rope_type = "llama3"`, low and high frequency factors 1 and 4): wavelengths longer
/// than `original_context` / 1 are stretched by `factor`, those shorter than `original_context` / 4 kept, the
/// ones between interpolated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Llama3Rope {
    pub factor: u32,
    pub original_context: usize,
}

/// The shape of a llama-family decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Shape {
    pub name: &'static str,
    pub family: Family,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// `hidden / heads` in llama; some mistral and qwen3 models have heads of another width.
    pub head_dim: usize,
    pub intermediate: usize,
    /// Rows of the embedding: the tokenizer's tokens, or more (see [`Vocabulary::size`]).
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: u32,
    pub rope_scaling: Option<Llama3Rope>,
    pub tied: bool,
    /// Gemma's sliding window (the layers that slide follow the family's pattern).
    pub sliding_window: Option<usize>,
    /// A mixture of experts (Mixtral, Qwen3-MoE) in place of each layer's feed-forward network.
    pub moe: Option<MoeShape>,
    /// Partial rotary: RoPE on the first this many values of each head (Phi-4-mini's 96 of 128), written as
    /// `partial_rotary_factor` and GGUF's `rope.dimension_count`; `None`, whole heads.
    pub rotary_dim: Option<usize>,
}

/// A mixture of experts' shape: experts per layer, experts per token, and each expert's feed-forward width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MoeShape {
    pub experts: usize,
    pub used: usize,
    pub intermediate: usize,
    /// A shared expert's width (Qwen2-MoE).
    pub shared: Option<usize>,
}

/// Shapes of published models, by name.
pub const SHAPES: &[Shape] = &[
    // meta-llama/Llama-3.2-1B: 1.24 B parameters.
    Shape {
        name: "llama-3.2-1b",
        family: Family::Llama,
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        head_dim: 64,
        intermediate: 8192,
        vocab: 128256,
        context: 131072,
        rope_theta: 500000,
        rope_scaling: Some(Llama3Rope { factor: 32, original_context: 8192 }),
        tied: true,
        sliding_window: None,
        moe: None,
        rotary_dim: None,
    },
    // HuggingFaceTB/SmolLM2-135M-Instruct: the CPU tests' model.
    Shape {
        name: "smollm2-135m",
        family: Family::Llama,
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        intermediate: 1536,
        vocab: 49152,
        context: 8192,
        rope_theta: 100000,
        rope_scaling: None,
        tied: true,
        sliding_window: None,
        moe: None,
        rotary_dim: None,
    },
    // Qwen/Qwen2.5-0.5B-Instruct: 494 M parameters, q/k/v biases, tied embeddings.
    Shape {
        name: "qwen2.5-0.5b",
        family: Family::Qwen2,
        hidden: 896,
        layers: 24,
        heads: 14,
        kv_heads: 2,
        head_dim: 64,
        intermediate: 4864,
        vocab: 151936,
        context: 32768,
        rope_theta: 1000000,
        rope_scaling: None,
        tied: true,
        sliding_window: None,
        moe: None,
        rotary_dim: None,
    },
    // Qwen/Qwen3-0.6B: 596 M parameters, heads of 128 (wider than hidden / heads), q/k norms, tied embeddings.
    Shape {
        name: "qwen3-0.6b",
        family: Family::Qwen3,
        hidden: 1024,
        layers: 28,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 3072,
        vocab: 151936,
        context: 40960,
        rope_theta: 1000000,
        rope_scaling: None,
        tied: true,
        sliding_window: None,
        moe: None,
        rotary_dim: None,
    },
    // A few megabytes, for tests.
    Shape {
        name: "tiny",
        family: Family::Llama,
        hidden: 128,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        intermediate: 256,
        vocab: 512,
        context: 1024,
        rope_theta: 10000,
        rope_scaling: None,
        tied: false,
        sliding_window: None,
        moe: None,
        rotary_dim: None,
    },
    // google/gemma-3-1b-it: 1.0 B parameters, heads of 256 (wider than hidden / heads), one kv head, a window of
    // 512 in five layers of six, tied embeddings.
    Shape {
        name: "gemma-3-1b",
        family: Family::Gemma3,
        hidden: 1152,
        layers: 26,
        heads: 4,
        kv_heads: 1,
        head_dim: 256,
        intermediate: 6912,
        vocab: 262144,
        context: 32768,
        rope_theta: 1000000,
        rope_scaling: None,
        tied: true,
        sliding_window: Some(512),
        moe: None,
        rotary_dim: None,
    },
    // microsoft/Phi-3-mini-4k-instruct: 3.8 B parameters, fused q/k/v and gate/up, heads of 96, a window of 2,047.
    Shape {
        name: "phi-3-mini",
        family: Family::Phi3,
        hidden: 3072,
        layers: 32,
        heads: 32,
        kv_heads: 32,
        head_dim: 96,
        intermediate: 8192,
        vocab: 32064,
        context: 4096,
        rope_theta: 10000,
        rope_scaling: None,
        tied: false,
        sliding_window: Some(2047),
        moe: None,
        rotary_dim: None,
    },
    // microsoft/Phi-4-mini-instruct: 3.8 B parameters, RoPE on 96 of each head's 128 values, grouped-query attention
    // (24 heads, 8 key/value heads), a 200,064-token vocabulary, tied embeddings; at its pre-trained context of 4,096
    // (its LongRoPE factors, which stretch it to 131,072, are not written).
    Shape {
        name: "phi-4-mini",
        family: Family::Phi3,
        hidden: 3072,
        layers: 32,
        heads: 24,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 8192,
        vocab: 200064,
        context: 4096,
        rope_theta: 10000,
        rope_scaling: None,
        tied: true,
        sliding_window: None,
        moe: None,
        rotary_dim: Some(96),
    },
    // google/gemma-2-2b-it: 2.6 B parameters, a window of 4,096 in every other layer, soft-capping, tied embeddings.
    Shape {
        name: "gemma-2-2b",
        family: Family::Gemma2,
        hidden: 2304,
        layers: 26,
        heads: 8,
        kv_heads: 4,
        head_dim: 256,
        intermediate: 9216,
        vocab: 256000,
        context: 8192,
        rope_theta: 10000,
        rope_scaling: None,
        tied: true,
        sliding_window: Some(4096),
        moe: None,
        rotary_dim: None,
    },
    // Qwen/Qwen3-30B-A3B's experts (128, 8 per token) and heads (of 128, four query heads per key/value head) at half
    // its width (hidden 1,024, experts 384 wide) and 4 of its 48 layers: 0.9 B parameters, 0.2 B active per token
    // (the embeddings and output projection of its 151,936-token vocabulary most of them).
    Shape {
        name: "qwen3-moe-reduced",
        family: Family::Qwen3Moe,
        hidden: 1024,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        intermediate: 3072,
        vocab: 151936,
        context: 40960,
        rope_theta: 1000000,
        rope_scaling: None,
        tied: false,
        sliding_window: None,
        moe: Some(MoeShape { experts: 128, used: 8, intermediate: 384, shared: None }),
        rotary_dim: None,
    },
    // mistralai/Mixtral-8x7B-Instruct-v0.1's experts (8, 2 per token) and heads (of 128, four query heads per key/value
    // head) at a quarter of its width (hidden 1,024, experts 3,584 wide) and 4 of its 32 layers: 0.4 B parameters.
    Shape {
        name: "mixtral-reduced",
        family: Family::Mixtral,
        hidden: 1024,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        intermediate: 3584,
        vocab: 32000,
        context: 32768,
        rope_theta: 1000000,
        rope_scaling: None,
        tied: false,
        sliding_window: None,
        moe: Some(MoeShape { experts: 8, used: 2, intermediate: 3584, shared: None }),
        rotary_dim: None,
    },
    // Qwen/Qwen1.5-MoE-A2.7B's experts (60, 4 per token, and a shared one four experts wide) and heads (of 128, a
    // key/value head per query head) at half its width (hidden 1,024, experts 704 and the shared expert 2,816 wide)
    // and 4 of its 24 layers: 0.9 B parameters (0.3 B of them the embeddings and output projection of Qwen2's
    // 151,936-token vocabulary), 0.4 B active per token.
    Shape {
        name: "qwen2-moe-reduced",
        family: Family::Qwen2Moe,
        hidden: 1024,
        layers: 4,
        heads: 8,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 2816,
        vocab: 151936,
        context: 8192,
        rope_theta: 1000000,
        rope_scaling: None,
        tied: false,
        sliding_window: None,
        moe: Some(MoeShape { experts: 60, used: 4, intermediate: 704, shared: Some(2816) }),
        rotary_dim: None,
    },
    // allenai/OLMoE-1B-7B-0924's experts (64, 8 per token, 1,024 wide) and heads (16 of 128, a key/value head per
    // query head) at half its width (hidden 1,024, 8 heads) and 4 of its 16 layers: 0.65 B parameters (0.1 B of them
    // the embeddings and output projection of its 50,304-token vocabulary).
    Shape {
        name: "olmoe-reduced",
        family: Family::Olmoe,
        hidden: 1024,
        layers: 4,
        heads: 8,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 1024,
        vocab: 50304,
        context: 4096,
        rope_theta: 10000,
        rope_scaling: None,
        tied: false,
        sliding_window: None,
        moe: Some(MoeShape { experts: 64, used: 8, intermediate: 1024, shared: None }),
        rotary_dim: None,
    },
];

impl Shape {
    pub fn named(name: &str) -> Result<Shape, Error> {
        SHAPES.iter().find(|s| s.name == name).copied().ok_or_else(|| {
            let known = SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ");
            Error::Internal(format!("unknown model shape `{name}` (known: {known})"))
        })
    }

    /// Parameters, embeddings included (once when tied), biases and q/k norms included.
    pub fn parameters(&self) -> usize {
        let (d, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let biases = if self.family.qkv_bias() { q + 2 * kv } else { 0 };
        let qk_norms = match (self.family.qk_norm(), self.family.qk_norm_rows()) {
            (true, true) => q + kv,
            (true, false) => 2 * self.head_dim,
            (false, _) => 0,
        };
        let post_norms = if self.family.is_gemma() { 2 * d } else { 0 };
        let ffn = match self.moe {
            Some(m) => m.experts * (3 * d * m.intermediate + d) + m.shared.map_or(0, |s| 3 * d * s + d),
            None => 3 * d * self.intermediate,
        };
        let layer = 2 * d * q + 2 * d * kv + ffn + 2 * d + biases + qk_norms + post_norms;
        self.vocab * d * if self.tied { 1 } else { 2 } + self.layers * layer + d
    }
}

/// ChatML, the synthetic models' chat template.
const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A synthetic tokenizer: byte-level BPE with GPT-2's 256 byte tokens, a token for each merge, ChatML's special
/// tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, as control tokens), then filler tokens up to `size`
/// (reachable only by sampling, never by tokenizing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vocabulary {
    /// BPE merges as tokenizer.json writes them (`"Ġ t"`), in priority order. None: a prompt is one token per byte.
    pub merges: &'static [&'static str],
    /// Tokens in all: at most the shape's vocabulary, whose rows past it no token names (as in the padded
    /// vocabularies of Qwen2 checkpoints).
    pub size: usize,
    /// Whether the tokenizer adds `<|endoftext|>` before a prompt, as Llama 3's adds its BOS. Without it a prompt
    /// starts with its chat template's first token, as ChatML models' do.
    pub add_bos: bool,
}

impl Vocabulary {
    /// The id of one of [`SPECIALS`].
    fn special(&self, token: &str) -> u32 {
        let index = SPECIALS.iter().position(|s| *s == token).expect("a ChatML special token");
        (256 + self.merges.len() + index) as u32
    }

    /// The vocabulary as a tokenizer's metadata: byte tokens (GPT-2's byte-to-character mapping), merged tokens,
    /// the special tokens, then fillers.
    fn metadata(&self) -> Result<VocabMetadata, Error> {
        let named = 256 + self.merges.len() + SPECIALS.len();
        if self.size < named {
            return Err(Error::Internal(format!("a vocabulary of {} tokens is smaller than its {named} named tokens", self.size)));
        }
        let mut tokens = Vec::with_capacity(self.size);
        let mut next = 256u32;
        for b in 0u32..256 {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            let c = if printable {
                b
            } else {
                next += 1;
                next - 1
            };
            tokens.push(char::from_u32(c).expect("below U+0200").to_string());
        }
        tokens.extend(self.merges.iter().map(|m| m.replace(' ', "")));
        tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
        while tokens.len() < self.size {
            tokens.push(format!("<|filler_{}|>", tokens.len()));
        }
        let mut token_types = vec![1i32; self.size];
        let specials = 256 + self.merges.len();
        token_types[specials..specials + SPECIALS.len()].fill(crate::tokenize::vocab::TOKEN_TYPE_CONTROL);
        let merges = self.merges.iter().map(|m| m.to_string()).collect();
        Ok(VocabMetadata { kind: "gpt2".into(), pre: Some("gpt-2".into()), tokens, token_types, merges, ..Default::default() })
    }
}

/// How the random weights are drawn (uniform, by [`Random`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// As Hugging Face initialises a model (uniform with about its 0.02 standard deviation; norm weights 1, biases
    /// 0), so activations keep their scale through the layers. For benchmarks, where only shapes matter.
    Hf,
    /// Every weight shows in the logits, and the logits are peaked: embeddings in ±1, each matrix in
    /// ±1/sqrt(its input width) (the output projection four times that), norm weights in 1 ± 0.2 (q/k norms
    /// 1 ± 0.5), biases in ±0.5. For tests that hold one implementation against another: a norm weight or bias
    /// that one of them drops changes the logits, and greedy tokens do not hang on near-ties.
    Peaked,
    /// [`Init::Peaked`], with the q and k projections [`FIDELITY_QK_GAIN`] times wider ([`FIDELITY_QK_GAIN_LLAMA`]
    /// for the llama family; attention picks positions, so the context and RoPE show in the logits) and the output
    /// projection [`FIDELITY_OUTPUT_GAIN`] / sqrt(width) (a tied embedding too), and for Phi-3, Mixtral and Gemma 2
    /// the sublayers' outputs smaller and Mixtral's router less wide ([`fidelity_sublayer_and_router_gains`]): for
    /// fidelity against llama.cpp on a published shape (`synth-model --init fidelity`, scripts/fidelity-llama.py).
    /// Measured on a Qwen2.5-0.5B-shaped model with Qwen2's vocabulary: llama.cpp's top token leads the next by 9
    /// nats at the median position, so rounding does not flip it (top-1 agreement 100 % in F16), while a wrong RoPE
    /// base or dropped biases do (96.5 % and 52 %: BENCHMARKS.md).
    Fidelity,
}

/// A synthetic model, whole: the same spec writes the same bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec {
    pub shape: Shape,
    pub vocabulary: Vocabulary,
    /// The weights' type in model.safetensors: bf16, f16 or f32. A GGUF is quantized from these values.
    pub dtype: DType,
    pub init: Init,
    /// The generator's starting state ([`Random::new`]).
    pub seed: u64,
}

impl Spec {
    /// What `synth-model` writes: `shape` with the byte-level vocabulary filling it, Hugging Face's initialisation,
    /// and `seed` spread over the generator's state (so seeds 0, 1, 2 give unrelated weights).
    pub fn new(shape: &Shape, dtype: DType, seed: u64) -> Spec {
        Spec {
            shape: *shape,
            vocabulary: Vocabulary { merges: &[], size: shape.vocab, add_bos: false },
            dtype,
            init: Init::Hf,
            seed: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        }
    }
}

/// Uniform values in [-scale, scale) from xorshift64: fast, and the same for a seed on every machine.
pub struct Random(u64);

impl Random {
    /// A generator starting from `seed` (made odd: xorshift needs a state that is not zero).
    pub fn new(seed: u64) -> Random {
        Random(seed | 1)
    }

    /// An f32 tensor of `dims`, the generator's next values in row-major order.
    pub fn tensor(&mut self, dims: &[usize], scale: f32) -> Result<Tensor, Error> {
        let n: usize = dims.iter().product();
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            values.push(((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale);
        }
        Tensor::from_vec(values, dims, &Device::Cpu).map_err(|e| Error::Internal(format!("cannot build a random tensor: {e}")))
    }
}

/// Draws a spec's tensors in its order, each as its [`Init`] says, and converts them to its dtype.
struct Draw {
    random: Random,
    init: Init,
    dtype: DType,
}

impl Draw {
    fn finish(&self, t: candle_core::Result<Tensor>) -> Result<Tensor, Error> {
        t.and_then(|t| t.to_dtype(self.dtype)).map_err(|e| Error::Internal(format!("cannot build a random tensor: {e}")))
    }

    /// Uniform in ±`peaked` (ignored by Hugging Face's initialisation).
    fn uniform(&mut self, dims: &[usize], peaked: f32) -> Result<Tensor, Error> {
        let scale = match self.init {
            Init::Hf => 0.02 * 3f32.sqrt(),
            Init::Peaked | Init::Fidelity => peaked,
        };
        let t = self.random.tensor(dims, scale)?;
        self.finish(Ok(t))
    }

    /// A `rows` x `columns` projection, `gain` / sqrt(columns) wide when peaked.
    fn matrix(&mut self, rows: usize, columns: usize, gain: f32) -> Result<Tensor, Error> {
        self.uniform(&[rows, columns], gain * (1.0 / (columns as f32).sqrt()))
    }

    /// A norm weight: 1 ± `spread` when peaked, else 1.
    fn norm(&mut self, n: usize, spread: f32) -> Result<Tensor, Error> {
        let t = match self.init {
            Init::Hf => Tensor::ones(n, DType::F32, &Device::Cpu),
            Init::Peaked | Init::Fidelity => self.random.tensor(&[n], spread)?.affine(1.0, 1.0),
        };
        self.finish(t)
    }

    /// A bias: ±0.5 when peaked, else 0.
    fn bias(&mut self, n: usize) -> Result<Tensor, Error> {
        match self.init {
            Init::Hf => self.finish(Tensor::zeros(n, DType::F32, &Device::Cpu)),
            Init::Peaked | Init::Fidelity => self.uniform(&[n], 0.5),
        }
    }
}

/// [`Init::Fidelity`]'s q and k projections, over 1/sqrt(width), for qwen2 and qwen3. Twice as wide, attention no
/// longer picks positions stably: rounding then flips llama.cpp's and nightshift's choices (91 % agreement in F16
/// at gain 8).
pub const FIDELITY_QK_GAIN: f32 = 4.0;
/// The same for the llama family, whose attention has neither qwen2's biases nor qwen3's q/k norms to steady it: at
/// 4, a 30-layer model of width 576 magnifies llama.cpp's f16 rounding to 0.14-0.17 of the largest logit over 200
/// tokens (nightshift is 3e-4 from a float64 forward pass there); at 3, 0.003, as qwen2 at 4.
pub const FIDELITY_QK_GAIN_LLAMA: f32 = 3.0;
/// [`Init::Fidelity`]'s mixture-of-experts routers, over 1/sqrt(width). An expert whose probability is near the
/// chosen ones' last changes places with the next under rounding (llama.cpp's f16 activations against nightshift's
/// f32); a wide router makes such an expert's weight small, so that the swap hardly shows in the logits.
pub const FIDELITY_ROUTER_GAIN: f32 = 16.0;
/// How much [`Init::Fidelity`]'s sublayers add to the residual stream, and its router gain, per family: the gain
/// of the attention and feed-forward output projections (each expert's too) over 1/sqrt(width), or for Gemma, whose
/// post-norms normalize those projections' results, of the post-norms' weights. Measured with
/// `scripts/fidelity-llama.py` against llama.cpp (BENCHMARKS.md), top-1 agreement on F16 / Q8_0 / Q4_K_M:
/// - Phi-3 and Mixtral (untied output projections; no biases, q/k norms or post-norms to steady them) at a quarter:
///   each layer's rounding in a quantized file moves the logits a quarter as far, and every layer still shows in
///   them (T5's [`t5::SUBLAYER_OUTPUT_GAIN`], the same measure). Phi-3-mini's shape in 8 layers went from 98.3 /
///   93.3 / 90.9 % to 99.4 / 98.0 / 97.5 %, the reduced Mixtral from 99.6 / 96.8 / 95.5 % to 100.0 / 98.9 / 98.3 %.
///   Deeper, rounding sums over more layers (Phi-3 at all 32 layers and a quarter: 98.7 / 97.4 / 94.6 %), so
///   Phi-3's gain shrinks with depth past 8 layers as GPT-2's residual projections do, 1/sqrt(2 x layers): an eighth
///   at 32 layers, 99.9 / 97.9 / 97.5 % (seed 4), a copy with RoPE broken at 47.1 %.
///   A swap of the chosen experts under rounding then hardly shows either, so Mixtral's router is drawn at 4 rather
///   than [`FIDELITY_ROUTER_GAIN`]: its second expert weighs enough for a copy that does not renormalize the two to
///   show (96.9 %; at 16, 98.6 %, not caught).
/// - Gemma 2 at 0.7, between two failures of its tied embedding: at 1, 26 post-normed layers' rounding moved the
///   Q8_0 logits by 16 % of the largest (89.6 %); at 0.5, the embedding's copy of the current token led by 7 nats
///   wherever it stood, and a copy with RoPE broken still agreed on 100 % of top tokens. At 0.7: 99.9 / 99.4 /
///   98.4 %, RoPE broken 96.4 %.
/// - The others as they were: Gemma 3 meets every target, and at a quarter Qwen2-MoE fell to 92.5 % (F16).
fn fidelity_sublayer_and_router_gains(family: Family, layers: usize) -> (f32, f32) {
    match family {
        Family::Gemma2 => (0.7, FIDELITY_ROUTER_GAIN),
        // A quarter up to 8 layers, then GPT-2's 1 / sqrt(2 x layers): 0.125 at 32.
        Family::Phi3 => (0.25f32.min(1.0 / (2.0 * layers.max(1) as f32).sqrt()), FIDELITY_ROUTER_GAIN),
        Family::Mixtral => (0.25, 4.0),
        _ => (1.0, FIDELITY_ROUTER_GAIN),
    }
}
/// [`Init::Fidelity`]'s output projection, over 1/sqrt(width). At 4 the top token leads the next by a third of a nat
/// at the median, and rounding flips a few percent of positions.
pub const FIDELITY_OUTPUT_GAIN: f32 = 8.0;

/// A spec's weights under their Hugging Face names, in its dtype.
fn weights(spec: &Spec) -> Result<HashMap<String, Tensor>, Error> {
    let shape = &spec.shape;
    let (d, hd, ff) = (shape.hidden, shape.head_dim, shape.intermediate);
    let (q, kv) = (shape.heads * hd, shape.kv_heads * hd);
    let mut draw = Draw { random: Random::new(spec.seed), init: spec.init, dtype: spec.dtype };
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let fidelity = spec.init == Init::Fidelity;
    let (qk_gain, output_gain) = match (fidelity, shape.family) {
        // Attention without biases or q/k norms to steady it (llama, Gemma 2, Phi-3): the llama family's gain.
        (true, Family::Llama | Family::Gemma2 | Family::Phi3 | Family::Mixtral) => (FIDELITY_QK_GAIN_LLAMA, FIDELITY_OUTPUT_GAIN),
        (true, _) => (FIDELITY_QK_GAIN, FIDELITY_OUTPUT_GAIN),
        (false, _) => (1.0, 4.0),
    };
    let (sublayer_gain, fidelity_router_gain) = fidelity_sublayer_and_router_gains(shape.family, shape.layers);
    let sublayer_gain = if fidelity { sublayer_gain } else { 1.0 };
    // Gemma's post-norms normalize its sublayers' outputs: their weights, not the projections, set the size.
    let (projection_gain, post_norm_gain) = if shape.family.is_gemma() { (1.0, sublayer_gain) } else { (sublayer_gain, 1.0) };
    // Tied, the embedding is the output projection too: for fidelity it is drawn at the output projection's scale,
    // so that the logits are nats apart rather than hundreds (the first layer's RMSNorm undoes its scale). Gemma
    // multiplies its embeddings by sqrt(hidden): drawn that wide, each position's own token would lead the logits by
    // about a hundred nats whatever the context, so its embedding is drawn at 1 / sqrt(hidden) (the scaled
    // embedding in ±1, the layers' post-normed outputs outweighing it) and the output gain goes into the final
    // norm's weight instead.
    let gemma_gain = shape.family.is_gemma() && shape.tied && fidelity;
    let embedding = match shape.tied && fidelity {
        true if gemma_gain => draw.matrix(shape.vocab, d, 1.0)?,
        true => draw.matrix(shape.vocab, d, output_gain)?,
        false => draw.uniform(&[shape.vocab, d], 1.0)?,
    };
    tensors.insert("model.embed_tokens.weight".into(), embedding);
    // Gemma stores its RMSNorm weights as `w` for `1 + w`: the same multipliers, less one.
    let gemma = shape.family.is_gemma();
    let norm_times = |draw: &mut Draw, n: usize, spread: f32, gain: f32| -> Result<Tensor, Error> {
        let w = draw.norm(n, spread)?;
        match gemma {
            true => draw.finish(w.to_dtype(DType::F32).and_then(|w| w.affine(f64::from(gain), -1.0))),
            false => Ok(w),
        }
    };
    let norm = |draw: &mut Draw, n: usize, spread: f32| norm_times(draw, n, spread, 1.0);
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        tensors.insert(format!("{p}.input_layernorm.weight"), norm(&mut draw, d, 0.2)?);
        // Llama's norm before the feed-forward network; Gemma's after attention, with its two more.
        tensors.insert(format!("{p}.post_attention_layernorm.weight"), norm_times(&mut draw, d, 0.2, post_norm_gain)?);
        if gemma {
            tensors.insert(format!("{p}.pre_feedforward_layernorm.weight"), norm(&mut draw, d, 0.2)?);
            tensors.insert(format!("{p}.post_feedforward_layernorm.weight"), norm_times(&mut draw, d, 0.2, post_norm_gain)?);
        }
        tensors.insert(format!("{p}.self_attn.q_proj.weight"), draw.matrix(q, d, qk_gain)?);
        tensors.insert(format!("{p}.self_attn.k_proj.weight"), draw.matrix(kv, d, qk_gain)?);
        tensors.insert(format!("{p}.self_attn.v_proj.weight"), draw.matrix(kv, d, 1.0)?);
        tensors.insert(format!("{p}.self_attn.o_proj.weight"), draw.matrix(d, q, projection_gain)?);
        if shape.family.qkv_bias() {
            tensors.insert(format!("{p}.self_attn.q_proj.bias"), draw.bias(q)?);
            tensors.insert(format!("{p}.self_attn.k_proj.bias"), draw.bias(kv)?);
            tensors.insert(format!("{p}.self_attn.v_proj.bias"), draw.bias(kv)?);
        }
        if shape.family.qk_norm() {
            // Per head, or (OLMoE) over the whole q and k rows.
            let (qn, kn) = if shape.family.qk_norm_rows() { (q, kv) } else { (hd, hd) };
            tensors.insert(format!("{p}.self_attn.q_norm.weight"), norm(&mut draw, qn, 0.5)?);
            tensors.insert(format!("{p}.self_attn.k_norm.weight"), norm(&mut draw, kn, 0.5)?);
        }
        match shape.moe {
            // Peaked: the router's logits a few units apart, so that bf16 rounding seldom swaps the chosen experts
            // (at gain 1, a tiny Mixtral's bf16 logits were 7.5 % of the largest from f32's) while the next-chosen
            // expert still weighs in.
            Some(moe) => {
                let router_gain = match spec.init {
                    Init::Fidelity => fidelity_router_gain,
                    Init::Peaked => 4.0,
                    Init::Hf => 1.0,
                };
                let (router, expert): (&str, fn(usize) -> [String; 3]) = match shape.family {
                    Family::Mixtral => ("block_sparse_moe.gate", |e| ["w1", "w3", "w2"].map(|w| format!("block_sparse_moe.experts.{e}.{w}.weight"))),
                    _ => ("mlp.gate", |e| ["gate_proj", "up_proj", "down_proj"].map(|w| format!("mlp.experts.{e}.{w}.weight"))),
                };
                tensors.insert(format!("{p}.{router}.weight"), draw.matrix(moe.experts, d, router_gain)?);
                for e in 0..moe.experts {
                    let [gate, up, down] = expert(e);
                    tensors.insert(format!("{p}.{gate}"), draw.matrix(moe.intermediate, d, 1.0)?);
                    tensors.insert(format!("{p}.{up}"), draw.matrix(moe.intermediate, d, 1.0)?);
                    tensors.insert(format!("{p}.{down}"), draw.matrix(d, moe.intermediate, projection_gain)?);
                }
                // Qwen2-MoE's shared expert and its gate (one row: a logit whose sigmoid weighs the expert).
                if let Some(width) = moe.shared {
                    tensors.insert(format!("{p}.mlp.shared_expert.gate_proj.weight"), draw.matrix(width, d, 1.0)?);
                    tensors.insert(format!("{p}.mlp.shared_expert.up_proj.weight"), draw.matrix(width, d, 1.0)?);
                    tensors.insert(format!("{p}.mlp.shared_expert.down_proj.weight"), draw.matrix(d, width, projection_gain)?);
                    tensors.insert(format!("{p}.mlp.shared_expert_gate.weight"), draw.matrix(1, d, 1.0)?);
                }
            }
            None => {
                tensors.insert(format!("{p}.mlp.gate_proj.weight"), draw.matrix(ff, d, 1.0)?);
                tensors.insert(format!("{p}.mlp.up_proj.weight"), draw.matrix(ff, d, 1.0)?);
                tensors.insert(format!("{p}.mlp.down_proj.weight"), draw.matrix(d, ff, projection_gain)?);
            }
        }
    }
    let final_gain = if gemma_gain { output_gain } else { 1.0 };
    tensors.insert("model.norm.weight".into(), norm_times(&mut draw, d, 0.2, final_gain)?);
    // Phi-3 stores q, k and v as one matrix, and gate and up as one (the same draws, concatenated by rows).
    if shape.family == Family::Phi3 {
        let cat = |tensors: &mut HashMap<String, Tensor>, parts: &[String], to: String| -> Result<(), Error> {
            let parts: Vec<Tensor> = parts.iter().map(|p| tensors.remove(p).expect("drawn above")).collect();
            let fused = Tensor::cat(&parts, 0).map_err(|e| Error::Internal(format!("cannot fuse {to}: {e}")))?;
            tensors.insert(to, fused);
            Ok(())
        };
        for i in 0..shape.layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            cat(&mut tensors, &[p("self_attn.q_proj.weight"), p("self_attn.k_proj.weight"), p("self_attn.v_proj.weight")], p("self_attn.qkv_proj.weight"))?;
            cat(&mut tensors, &[p("mlp.gate_proj.weight"), p("mlp.up_proj.weight")], p("mlp.gate_up_proj.weight"))?;
        }
    }
    if !shape.tied {
        tensors.insert("lm_head.weight".into(), draw.matrix(shape.vocab, d, output_gain)?);
    }
    Ok(tensors)
}

/// The tokenizer a GGUF gets: the synthetic byte-level one, or a real vocabulary read from another GGUF file (a
/// model's, or one of llama.cpp's vocabulary-only files), carried over key for key.
#[derive(Clone, Debug)]
pub enum GgufTokenizer {
    ByteLevel(Vocabulary),
    /// The tokenizer keys of a GGUF file, and its chat template.
    From(Box<crate::tokenize::gguf::Metadata>, Option<String>),
}

impl GgufTokenizer {
    /// The tokenizer of the GGUF file at `path`.
    pub fn from_file(path: &Path) -> Result<GgufTokenizer, Error> {
        let (meta, template) = crate::engine::models::llama::gguf::read_tokenizer(path)?;
        Ok(GgufTokenizer::From(Box::new(meta), template))
    }

    /// Tokens in all: the embedding's rows.
    pub fn size(&self) -> usize {
        match self {
            GgufTokenizer::ByteLevel(v) => v.size,
            GgufTokenizer::From(meta, _) => meta.tokens.len(),
        }
    }
}

/// Llama 2's chat template (for a vocabulary without ChatML's markers and without a template of its own).
const LLAMA2_CHAT: &str = "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{% elif message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}";

/// Writes the model in `dir` (written by [`synth_model`]) as `dir/model-<type>.gguf`, its matrices quantized to
/// `quant` (in parallel), norms and biases in f32, with `tokenizer` (by default the directory's own byte-level
/// one). Returns the file's path and size.
pub fn synth_gguf(dir: &Path, quant: GgmlDType, tokenizer: Option<&GgufTokenizer>) -> Result<(std::path::PathBuf, u64), Error> {
    let fail = |e: &dyn std::fmt::Display| Error::Internal(format!("cannot write a GGUF of `{}`: {e}", dir.display()));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(|e| fail(&e))?).map_err(|e| fail(&e))?;
    let get = |key: &str| config[key].as_u64().map(|v| v as usize).ok_or_else(|| fail(&format!("config.json has no `{key}`")));
    let (hidden, heads) = (get("hidden_size")?, get("num_attention_heads")?);
    let weights = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).map_err(|e| fail(&e))?;
    let family = match config["model_type"].as_str() {
        Some("qwen2") => Family::Qwen2,
        Some("qwen3") => Family::Qwen3,
        Some("mistral") => Family::Mistral,
        Some("gemma2") => Family::Gemma2,
        Some("gemma3_text") => Family::Gemma3,
        Some("phi3") => Family::Phi3,
        Some("mixtral") => Family::Mixtral,
        Some("qwen3_moe") => Family::Qwen3Moe,
        Some("qwen2_moe") => Family::Qwen2Moe,
        Some("olmoe") => Family::Olmoe,
        _ => Family::Llama,
    };
    let moe = match (get("num_local_experts").or_else(|_| get("num_experts")), get("num_experts_per_tok")) {
        (Ok(experts), Ok(used)) => Some(MoeShape {
            experts,
            used,
            intermediate: get("moe_intermediate_size").or_else(|_| get("intermediate_size"))?,
            shared: get("shared_expert_intermediate_size").ok(),
        }),
        _ => None,
    };
    let shape = Shape {
        name: "synthetic",
        family,
        hidden,
        layers: get("num_hidden_layers")?,
        heads,
        kv_heads: get("num_key_value_heads")?,
        head_dim: get("head_dim").unwrap_or(hidden / heads),
        intermediate: get("intermediate_size")?,
        vocab: get("vocab_size")?,
        context: get("max_position_embeddings")?,
        rope_theta: config["rope_theta"].as_f64().unwrap_or(10_000.0) as u32,
        rope_scaling: None,
        tied: !weights.contains_key("lm_head.weight"),
        sliding_window: get("sliding_window").ok().filter(|&w| family.is_gemma() || (family == Family::Phi3 && w < get("max_position_embeddings").unwrap_or(usize::MAX))),
        moe,
        rotary_dim: config["partial_rotary_factor"].as_f64().map(|f| (get("head_dim").unwrap_or(hidden / heads) as f64 * f) as usize),
    };
    let tokenizer = tokenizer.cloned().unwrap_or(GgufTokenizer::ByteLevel(Vocabulary { merges: &[], size: shape.vocab, add_bos: false }));
    if tokenizer.size() != shape.vocab {
        return Err(fail(&format!("a vocabulary of {} tokens for an embedding of {} rows", tokenizer.size(), shape.vocab)));
    }
    let model = GgufModel {
        name: format!("synthetic {}", config["_name_or_path"].as_str().unwrap_or(family.model_type())),
        shape: &shape,
        rms_eps: config["rms_norm_eps"].as_f64().unwrap_or(1e-5) as f32,
        tokenizer,
    };
    let path = dir.join(format!("model-{}.gguf", format!("{quant:?}").to_lowercase()));
    let bytes = write_gguf_file(&path, &model, &weights, quant).map_err(|e| fail(&e))?;
    Ok((path, bytes))
}

/// Writes `spec`'s model as one GGUF file at `path`: the weights [`write_hf`] writes for the same spec (through its
/// dtype), matrices quantized to `quant`, norms and biases in f32, llama's q and k permuted and the RoPE scaling left
/// out as for [`synth_gguf`]. Returns the file's size.
pub fn write_gguf(path: &Path, spec: &Spec, quant: GgmlDType) -> Result<u64, Error> {
    let shape = &spec.shape;
    let model = GgufModel { name: format!("synthetic {}", shape.name), shape, rms_eps: 1e-5, tokenizer: GgufTokenizer::ByteLevel(spec.vocabulary) };
    write_gguf_file(path, &model, &weights(spec)?, quant)
        .map_err(|e| Error::Internal(format!("cannot write the GGUF `{}`: {e}", path.display())))
}

/// Gemma 2's attention and final soft-caps, as its checkpoints configure them.
const GEMMA2_SOFTCAPS: (f32, f32) = (50.0, 30.0);
/// Gemma 3's local layers' RoPE base (`rope_local_base_freq`).
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// What a GGUF file says of its model besides the weights.
struct GgufModel<'a> {
    name: String,
    shape: &'a Shape,
    rms_eps: f32,
    tokenizer: GgufTokenizer,
}

/// The GGUF architecture of a family, as llama.cpp names it: Mistral's checkpoints are llama's.
fn gguf_architecture(family: Family) -> &'static str {
    match family {
        Family::Llama | Family::Mistral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Gemma2 => "gemma2",
        Family::Gemma3 => "gemma3",
        Family::Phi3 => "phi3",
        Family::Mixtral => "llama",
        Family::Qwen3Moe => "qwen3moe",
        Family::Qwen2Moe => "qwen2moe",
        Family::Olmoe => "olmoe",
    }
}

/// The tokenizer's keys, as llama.cpp's converter writes them.
fn tokenizer_keys(tokenizer: &GgufTokenizer) -> Result<Vec<(String, candle_core::quantized::gguf_file::Value)>, Error> {
    use candle_core::quantized::gguf_file::Value;
    let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let mut keys: Vec<(String, Value)> = Vec::new();
    let mut key = |k: &str, v: Value| keys.push((k.to_string(), v));
    match tokenizer {
        GgufTokenizer::ByteLevel(vocabulary) => {
            let meta = vocabulary.metadata()?;
            key("tokenizer.ggml.model", Value::String(meta.kind.clone()));
            key("tokenizer.ggml.pre", Value::String(meta.pre.clone().unwrap_or_default()));
            key("tokenizer.ggml.tokens", strings(&meta.tokens));
            key("tokenizer.ggml.token_type", Value::Array(meta.token_types.iter().map(|&t| Value::I32(t)).collect()));
            // An empty list is written as an array of strings after the fact ([`type_empty_string_arrays`]).
            key("tokenizer.ggml.merges", strings(&meta.merges));
            key("tokenizer.ggml.bos_token_id", Value::U32(vocabulary.special("<|endoftext|>")));
            key("tokenizer.ggml.eos_token_id", Value::U32(vocabulary.special("<|im_end|>")));
            key("tokenizer.ggml.add_bos_token", Value::Bool(vocabulary.add_bos));
            key("tokenizer.chat_template", Value::String(CHATML.into()));
        }
        GgufTokenizer::From(meta, template) => {
            key("tokenizer.ggml.model", Value::String(meta.model.clone()));
            if let Some(pre) = &meta.pre {
                key("tokenizer.ggml.pre", Value::String(pre.clone()));
            }
            key("tokenizer.ggml.tokens", strings(&meta.tokens));
            if let Some(types) = &meta.token_types {
                key("tokenizer.ggml.token_type", Value::Array(types.iter().map(|&t| Value::I32(t)).collect()));
            }
            if let Some(scores) = &meta.scores {
                key("tokenizer.ggml.scores", Value::Array(scores.iter().map(|&s| Value::F32(s)).collect()));
            }
            if let Some(merges) = &meta.merges {
                key("tokenizer.ggml.merges", strings(merges));
            }
            if let Some(map) = &meta.precompiled_charsmap {
                key("tokenizer.ggml.precompiled_charsmap", Value::Array(map.iter().map(|&b| Value::U8(b)).collect()));
            }
            let ids = &meta.ids;
            for (name, id) in [
                ("bos", ids.bos), ("eos", ids.eos), ("eot", ids.eot), ("eom", ids.eom), ("unknown", ids.unknown),
                ("seperator", ids.separator), ("padding", ids.padding), ("mask", ids.mask),
            ] {
                if let Some(id) = id {
                    key(&format!("tokenizer.ggml.{name}_token_id"), Value::U32(id));
                }
            }
            for (name, flag) in [
                ("add_bos_token", meta.add_bos), ("add_eos_token", meta.add_eos), ("add_sep_token", meta.add_sep),
                ("add_space_prefix", meta.add_space_prefix), ("remove_extra_whitespaces", meta.remove_extra_whitespaces),
            ] {
                if let Some(flag) = flag {
                    key(&format!("tokenizer.ggml.{name}"), Value::Bool(flag));
                }
            }
            let chatml = ["<|im_start|>", "<|im_end|>"].iter().all(|t| meta.tokens.iter().any(|x| x == t));
            let template = template.clone().unwrap_or_else(|| if chatml { CHATML.to_string() } else { LLAMA2_CHAT.to_string() });
            key("tokenizer.chat_template", Value::String(template));
        }
    }
    Ok(keys)
}

/// candle writes an empty array with the element type u32; llama.cpp reads `tokenizer.ggml.merges` only as an array
/// of strings. Rewrites the element type of each empty array among `keys` in the file's header to string (8).
fn type_empty_string_arrays(path: &Path, keys: &[&str]) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut header = Vec::new();
    (&mut file).take(64 << 20).read_to_end(&mut header)?;
    for key in keys {
        // key length (u64), key, value type 9 (array), element type 4 (u32), length 0 (u64)
        let mut pattern = (key.len() as u64).to_le_bytes().to_vec();
        pattern.extend_from_slice(key.as_bytes());
        pattern.extend_from_slice(&9u32.to_le_bytes());
        let Some(at) = header.windows(pattern.len() + 12).position(|w| w[..pattern.len()] == pattern[..] && w[pattern.len()..] == [4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]) else {
            continue;
        };
        file.seek(SeekFrom::Start((at + pattern.len()) as u64))?;
        file.write_all(&8u32.to_le_bytes())?;
    }
    file.sync_all()
}

/// Writes Hugging Face-named weights as GGUF for their family: matrices quantized to `quant` (in parallel), norms and
/// biases in f32, llama's q and k rows permuted for adjacent-pair RoPE (Qwen2's and Qwen3's stay as they are:
/// llama.cpp rotates halves for them). Returns the file's size.
fn write_gguf_file(path: &Path, model: &GgufModel, weights: &HashMap<String, Tensor>, quant: GgmlDType) -> Result<u64, Error> {
    use candle_core::quantized::gguf_file::Value;
    let fail = |e: &dyn std::fmt::Display| Error::Internal(e.to_string());
    let shape = model.shape;
    let hd = shape.head_dim;
    let arch = gguf_architecture(shape.family);
    let tensor = |name: &str| -> Result<Tensor, Error> {
        weights.get(name).ok_or_else(|| fail(&format!("no tensor `{name}`")))?.to_dtype(DType::F32).map_err(|e| fail(&e))
    };
    // A norm's weight as llama.cpp's converter stores it: Gemma's `w` as `1 + w`.
    let gemma = shape.family.is_gemma();
    let norm = |name: &str| -> Result<Tensor, Error> {
        match gemma {
            true => tensor(name)?.affine(1.0, 1.0).map_err(|e| fail(&e)),
            false => tensor(name),
        }
    };
    // Hugging Face rotates halves of each head; GGUF's llama weights are permuted for adjacent pairs.
    let rotary = |name: &str| -> Result<Tensor, Error> {
        match arch {
            "llama" => crate::engine::models::llama::hf::interleave_halves(&tensor(name)?, hd, shape.rotary_dim.unwrap_or(hd)).map_err(|e| fail(&e)),
            _ => tensor(name),
        }
    };
    let mut dense: Vec<(String, Tensor, GgmlDType)> = Vec::new();
    dense.push(("token_embd.weight".into(), tensor("model.embed_tokens.weight")?, quant));
    dense.push(("output_norm.weight".into(), norm("model.norm.weight")?, GgmlDType::F32));
    if weights.contains_key("lm_head.weight") {
        dense.push(("output.weight".into(), tensor("lm_head.weight")?, quant));
    }
    for i in 0..shape.layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        dense.push((b("attn_norm"), norm(&p("input_layernorm.weight"))?, GgmlDType::F32));
        match gemma {
            true => {
                dense.push((b("post_attention_norm"), norm(&p("post_attention_layernorm.weight"))?, GgmlDType::F32));
                dense.push((b("ffn_norm"), norm(&p("pre_feedforward_layernorm.weight"))?, GgmlDType::F32));
                dense.push((b("post_ffw_norm"), norm(&p("post_feedforward_layernorm.weight"))?, GgmlDType::F32));
            }
            false => dense.push((b("ffn_norm"), tensor(&p("post_attention_layernorm.weight"))?, GgmlDType::F32)),
        }
        dense.push((b("attn_output"), tensor(&p("self_attn.o_proj.weight"))?, quant));
        // Phi-3's fused matrices under llama.cpp's names (`attn_qkv`, and `ffn_up` of gate then up).
        match shape.family {
            Family::Phi3 => {
                dense.push((b("attn_qkv"), tensor(&p("self_attn.qkv_proj.weight"))?, quant));
                dense.push((b("ffn_up"), tensor(&p("mlp.gate_up_proj.weight"))?, quant));
            }
            _ => {
                dense.push((b("attn_q"), rotary(&p("self_attn.q_proj.weight"))?, quant));
                dense.push((b("attn_k"), rotary(&p("self_attn.k_proj.weight"))?, quant));
                dense.push((b("attn_v"), tensor(&p("self_attn.v_proj.weight"))?, quant));
            }
        }
        // Experts' matrices stacked `[experts, rows, columns]` (llama.cpp's `ffn_*_exps`), the router in F32 (as
        // llama.cpp's converter writes it and `llama-quantize` leaves it).
        match shape.moe {
            Some(moe) => {
                let (router, names): (&str, [&str; 3]) = match shape.family {
                    Family::Mixtral => ("block_sparse_moe.gate", ["block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2"]),
                    _ => ("mlp.gate", ["mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"]),
                };
                dense.push((b("ffn_gate_inp"), tensor(&p(&format!("{router}.weight")))?, GgmlDType::F32));
                for (name, gguf) in names.iter().zip(["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]) {
                    let parts = (0..moe.experts).map(|e| tensor(&p(&format!("{}.weight", name.replace("{e}", &e.to_string()))))).collect::<Result<Vec<_>, _>>()?;
                    dense.push((b(gguf), Tensor::stack(&parts, 0).map_err(|e| fail(&e))?, quant));
                }
                // Qwen2-MoE's shared expert (`*_shexp`), its gate a vector in F32 (llama.cpp's `{n_embd}`).
                if moe.shared.is_some() {
                    for (name, gguf) in [("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")] {
                        dense.push((b(gguf), tensor(&p(&format!("mlp.shared_expert.{name}.weight")))?, quant));
                    }
                    let gate = tensor(&p("mlp.shared_expert_gate.weight"))?.flatten_all().map_err(|e| fail(&e))?;
                    dense.push((b("ffn_gate_inp_shexp"), gate, GgmlDType::F32));
                }
            }
            None if shape.family == Family::Phi3 => dense.push((b("ffn_down"), tensor(&p("mlp.down_proj.weight"))?, quant)),
            None => {
                dense.push((b("ffn_gate"), tensor(&p("mlp.gate_proj.weight"))?, quant));
                dense.push((b("ffn_up"), tensor(&p("mlp.up_proj.weight"))?, quant));
                dense.push((b("ffn_down"), tensor(&p("mlp.down_proj.weight"))?, quant));
            }
        }
        for (hf, gguf) in [("q_proj.bias", "attn_q.bias"), ("k_proj.bias", "attn_k.bias"), ("v_proj.bias", "attn_v.bias")] {
            if weights.contains_key(&p(&format!("self_attn.{hf}"))) {
                let t = if hf == "v_proj.bias" { tensor(&p(&format!("self_attn.{hf}")))? } else { rotary(&p(&format!("self_attn.{hf}")))? };
                dense.push((format!("blk.{i}.{gguf}"), t, GgmlDType::F32));
            }
        }
        for (hf, gguf) in [("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")] {
            if weights.contains_key(&p(&format!("self_attn.{hf}.weight"))) {
                let t = if gemma { norm(&p(&format!("self_attn.{hf}.weight")))? } else { rotary(&p(&format!("self_attn.{hf}.weight")))? };
                dense.push((b(gguf), t, GgmlDType::F32));
            }
        }
    }
    let u32_of = |v: usize| Value::U32(v as u32);
    let a = |k: &str| format!("{arch}.{k}");
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(model.name.clone())),
        (a("context_length"), u32_of(shape.context)),
        (a("embedding_length"), u32_of(shape.hidden)),
        (a("block_count"), u32_of(shape.layers)),
        // Mixtral's and OLMoE's is their experts' width (they have no dense network).
        (a("feed_forward_length"), u32_of(match (shape.family, shape.moe) {
            (Family::Mixtral | Family::Olmoe, Some(moe)) => moe.intermediate,
            _ => shape.intermediate,
        })),
        (a("attention.head_count"), u32_of(shape.heads)),
        (a("attention.head_count_kv"), u32_of(shape.kv_heads)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(model.rms_eps)),
        (a("rope.freq_base"), Value::F32(shape.rope_theta as f32)),
    ];
    if let Some(rotated) = shape.rotary_dim {
        metadata.push((a("rope.dimension_count"), u32_of(rotated)));
    }
    if let Some(moe) = shape.moe {
        metadata.push((a("expert_count"), u32_of(moe.experts)));
        metadata.push((a("expert_used_count"), u32_of(moe.used)));
        if matches!(shape.family, Family::Qwen3Moe | Family::Qwen2Moe) {
            metadata.push((a("expert_feed_forward_length"), u32_of(moe.intermediate)));
        }
        if let Some(width) = moe.shared {
            metadata.push((a("expert_shared_feed_forward_length"), u32_of(width)));
        }
    }
    if shape.head_dim * shape.heads != shape.hidden || matches!(shape.family, Family::Qwen3 | Family::Qwen3Moe) || gemma {
        metadata.push((a("attention.key_length"), u32_of(hd)));
        metadata.push((a("attention.value_length"), u32_of(hd)));
    }
    // Gemma's keys as llama.cpp's converter writes them (the sliding layers' pattern and Gemma 3's local RoPE base
    // are llama.cpp's defaults, written out here all the same).
    if let Some(window) = shape.sliding_window.filter(|_| gemma || shape.family == Family::Phi3) {
        metadata.push((a("attention.sliding_window"), u32_of(window)));
    }
    match shape.family {
        Family::Gemma2 => {
            metadata.push((a("attn_logit_softcapping"), Value::F32(GEMMA2_SOFTCAPS.0)));
            metadata.push((a("final_logit_softcapping"), Value::F32(GEMMA2_SOFTCAPS.1)));
        }
        Family::Gemma3 => metadata.push((a("rope.freq_base_swa"), Value::F32(GEMMA3_LOCAL_ROPE_BASE))),
        _ => {}
    }
    metadata.extend(tokenizer_keys(&model.tokenizer)?);
    write_gguf_tensors(path, &metadata, dense)
}

/// Writes a GGUF file of `metadata` and `tensors`, each quantized to its type (in parallel) and written in the
/// order given; an empty `tokenizer.ggml.merges` typed as llama.cpp reads it. Returns the file's size.
fn write_gguf_tensors(path: &Path, metadata: &[(String, candle_core::quantized::gguf_file::Value)], tensors: Vec<(String, Tensor, GgmlDType)>) -> Result<u64, Error> {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::QTensor;
    use rayon::prelude::*;
    let fail = |e: &dyn std::fmt::Display| Error::Internal(format!("cannot write `{}`: {e}", path.display()));
    let quantized: Vec<(String, QTensor)> =
        tensors.into_par_iter().map(|(name, t, q)| QTensor::quantize(&t, q).map(|t| (name, t))).collect::<candle_core::Result<_>>().map_err(|e| fail(&e))?;
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).map_err(|e| fail(&e))?);
    let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = quantized.iter().map(|(k, v)| (k.as_str(), v)).collect();
    candle_core::quantized::gguf_file::write(&mut file, &meta, &refs).map_err(|e| fail(&e))?;
    std::io::Write::flush(&mut file).map_err(|e| fail(&e))?;
    drop(file);
    type_empty_string_arrays(path, &["tokenizer.ggml.merges"]).map_err(|e| fail(&e))?;
    std::fs::metadata(path).map(|m| m.len()).map_err(|e| fail(&e))
}

/// What was written.
#[derive(Debug, serde::Serialize)]
pub struct SynthReport {
    pub shape: Shape,
    pub dtype: String,
    pub parameters: usize,
    pub bytes: u64,
    pub seconds: f64,
}

/// Writes a random-weight model of `shape` into `dir` (created if needed).
pub fn synth_model(dir: &Path, shape: &Shape, dtype: DType, seed: u64, init: Init) -> Result<SynthReport, Error> {
    let started = std::time::Instant::now();
    let spec = Spec { init, ..Spec::new(shape, dtype, seed) };
    let bytes = write_hf(dir, &spec)?;
    let dtype = dtype_name(dtype)?;
    Ok(SynthReport { shape: *shape, dtype: dtype.into(), parameters: shape.parameters(), bytes, seconds: started.elapsed().as_secs_f64() })
}

/// config.json's name of a dtype synth writes.
fn dtype_name(dtype: DType) -> Result<&'static str, Error> {
    match dtype {
        DType::BF16 => Ok("bfloat16"),
        DType::F16 => Ok("float16"),
        DType::F32 => Ok("float32"),
        other => Err(Error::Internal(format!("synth-model writes bf16, f16 or f32 weights, not {other:?}"))),
    }
}

/// Writes `spec`'s model into `dir` (created if needed) as a Hugging Face directory. Returns the size of
/// model.safetensors.
pub fn write_hf(dir: &Path, spec: &Spec) -> Result<u64, Error> {
    let io = |what: &str, e: &dyn std::fmt::Display| Error::Internal(format!("cannot write {what} in `{}`: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(|e| io("the directory", &e))?;
    let (shape, vocabulary) = (&spec.shape, &spec.vocabulary);
    let dtype_name = dtype_name(spec.dtype)?;
    if vocabulary.size > shape.vocab {
        return Err(Error::Internal(format!("a tokenizer of {} tokens does not fit a vocabulary of {}", vocabulary.size, shape.vocab)));
    }
    let (bos, eos) = (vocabulary.special("<|endoftext|>"), vocabulary.special("<|im_end|>"));
    let mut config = json!({
        "architectures": [shape.family.class()], "model_type": shape.family.model_type(), "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "max_position_embeddings": shape.context, "vocab_size": shape.vocab, "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta as f64, "hidden_act": "silu", "tie_word_embeddings": shape.tied,
        "attention_bias": false, "mlp_bias": false, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": dtype_name,
    });
    if let Some(rotated) = shape.rotary_dim {
        config["partial_rotary_factor"] = json!(rotated as f64 / shape.head_dim as f64);
    }
    if let Some(rope) = shape.rope_scaling {
        config["rope_scaling"] = json!({"rope_type": "llama3", "factor": rope.factor as f64, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": rope.original_context});
    }
    match shape.family {
        Family::Llama => {}
        Family::Mistral => config["sliding_window"] = shape.context.into(),
        Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe | Family::Qwen2Moe => {
            config["sliding_window"] = shape.context.into();
            config["use_sliding_window"] = false.into();
            config["max_window_layers"] = shape.layers.into();
        }
        Family::Mixtral => config["sliding_window"] = serde_json::Value::Null,
        Family::Olmoe => config["clip_qkv"] = serde_json::Value::Null,
        Family::Phi3 => {
            config["sliding_window"] = shape.sliding_window.unwrap_or(shape.context).into();
        }
        Family::Gemma2 | Family::Gemma3 => {
            for key in ["hidden_act", "hidden_activation"] {
                config[key] = "gelu_pytorch_tanh".into();
            }
            config["query_pre_attn_scalar"] = shape.head_dim.into();
            config["sliding_window"] = shape.sliding_window.unwrap_or(shape.context).into();
            let gemma2 = shape.family == Family::Gemma2;
            config["attn_logit_softcapping"] = if gemma2 { json!(GEMMA2_SOFTCAPS.0) } else { serde_json::Value::Null };
            config["final_logit_softcapping"] = if gemma2 { json!(GEMMA2_SOFTCAPS.1) } else { serde_json::Value::Null };
            if !gemma2 {
                config["sliding_window_pattern"] = 6.into();
                config["rope_local_base_freq"] = json!(GEMMA3_LOCAL_ROPE_BASE);
            }
        }
    }
    if let Some(moe) = shape.moe {
        let key = if shape.family == Family::Mixtral { "num_local_experts" } else { "num_experts" };
        if matches!(shape.family, Family::Mixtral | Family::Olmoe) {
            config["intermediate_size"] = moe.intermediate.into();
        }
        if shape.family == Family::Olmoe {
            config["norm_topk_prob"] = false.into();
        }
        config[key] = moe.experts.into();
        config["num_experts_per_tok"] = moe.used.into();
        if matches!(shape.family, Family::Qwen3Moe | Family::Qwen2Moe) {
            config["moe_intermediate_size"] = moe.intermediate.into();
            config["norm_topk_prob"] = (shape.family == Family::Qwen3Moe).into();
            config["decoder_sparse_step"] = 1.into();
            config["mlp_only_layers"] = json!([]);
        }
        if let Some(width) = moe.shared {
            config["shared_expert_intermediate_size"] = width.into();
        }
        config["output_router_logits"] = false.into();
    }
    let write_json = |name: &str, value: &serde_json::Value| {
        std::fs::write(dir.join(name), serde_json::to_string_pretty(value).expect("JSON serialises")).map_err(|e| io(name, &e))
    };
    write_json("config.json", &config)?;
    write_json("generation_config.json", &json!({"bos_token_id": bos, "eos_token_id": eos}))?;
    let bos_token = if vocabulary.add_bos { json!(SPECIALS[0]) } else { serde_json::Value::Null };
    write_json(
        "tokenizer_config.json",
        &json!({"bos_token": bos_token, "add_bos_token": vocabulary.add_bos, "eos_token": "<|im_end|>", "chat_template": CHATML}),
    )?;
    let tokenizer = crate::tokenize::vocab::byte_level_json(&vocabulary.metadata()?)?;
    tokenizer.save(dir.join("tokenizer.json"), false).map_err(|e| io("tokenizer.json", &e))?;

    let weights_path = dir.join("model.safetensors");
    candle_core::safetensors::save(&weights(spec)?, &weights_path).map_err(|e| io("model.safetensors", &e))?;
    std::fs::metadata(&weights_path).map(|m| m.len()).map_err(|e| io("model.safetensors", &e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_1b_shape_is_llama_3_2_1b() {
        let s = Shape::named("llama-3.2-1b").unwrap();
        // Llama-3.2-1B's published size: 1,235,814,400 parameters (tied embeddings).
        assert_eq!(s.parameters(), 1_235_814_400);
        assert_eq!(s.head_dim, 64);
        assert!(Shape::named("gpt-5").unwrap_err().to_string().contains("llama-3.2-1b"));
    }

    #[test]
    fn a_synthetic_model_loads_tokenizes_bytes_and_has_its_shape() {
        let dir = std::env::temp_dir().join(format!("nightshift-synth-{}", std::process::id()));
        let shape = Shape::named("tiny").unwrap();
        let report = synth_model(&dir, &shape, DType::BF16, 7, Init::Hf).unwrap();
        assert_eq!(report.parameters, shape.parameters());
        let (model, info) = crate::engine::Model::load(&dir, &Device::Cpu).unwrap();
        assert_eq!((model.config.hidden_size, model.config.layers, model.config.vocab_size), (128, 2, 512));
        assert_eq!(info.vocab.eos, Some(258));
        let tokenizer = crate::tokenize::vocab::build(&info.vocab).unwrap();
        let ids = tokenizer.encode("héllo", false).unwrap();
        assert_eq!(ids.len(), "héllo".len(), "one token per byte");
        assert_eq!(tokenizer.decode(&ids, false), "héllo");
        // As GGUF: the same function, to quantization (q8_0 here), whichever path loads it.
        let (gguf, _) = synth_gguf(&dir, candle_core::quantized::GgmlDType::Q8_0, None).unwrap();
        let (quantized, gguf_info) = crate::engine::Model::load(&gguf, &Device::Cpu).unwrap();
        assert_eq!((quantized.config.hidden_size, quantized.config.layers, gguf_info.vocab.eos), (128, 2, Some(258)));
        let tokens: Vec<u32> = "hello, world".bytes().map(u32::from).collect();
        let logits = |m: &crate::engine::Model| {
            use crate::engine::Attention;
            let host = crate::engine::HostAttention::new(m, DType::F32).unwrap();
            let mut cache = host.new_cache(16);
            m.forward(&host, &mut [crate::engine::Segment { tokens: &tokens, cache: &mut cache }]).unwrap().remove(0)
        };
        let (a, b) = (logits(&model), logits(&quantized));
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 0.05 * scale, "the GGUF computes another function: {diff} of {scale}");
        // The same seed writes the same weights.
        let again = dir.join("again");
        synth_model(&again, &shape, DType::BF16, 7, Init::Hf).unwrap();
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), std::fs::read(again.join("model.safetensors")).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn parameters_count_every_tensor_of_every_family() {
        let tiny = Shape::named("tiny").unwrap();
        let families = [
            (Family::Llama, 32, false),
            (Family::Mistral, 48, false),
            (Family::Qwen2, 32, true),
            (Family::Qwen3, 40, true),
            (Family::Gemma2, 32, true),
            (Family::Gemma3, 40, true),
            (Family::Phi3, 32, false),
            (Family::Mixtral, 32, false),
            (Family::Qwen3Moe, 40, false),
            (Family::Qwen2Moe, 32, false),
        ];
        for (family, head_dim, tied) in families {
            let shared = (family == Family::Qwen2Moe).then_some(96);
            let moe = matches!(family, Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe).then_some(MoeShape { experts: 4, used: 2, intermediate: 64, shared });
            let shape = Shape { family, head_dim, tied, moe, ..tiny };
            for init in [Init::Hf, Init::Peaked, Init::Fidelity] {
                let spec = Spec { init, ..Spec::new(&shape, DType::F32, 1) };
                let written: usize = weights(&spec).unwrap().values().map(|t| t.elem_count()).sum();
                assert_eq!(written, shape.parameters(), "{family:?}, {init:?}");
            }
        }
    }

    #[test]
    fn phi3_fidelity_sublayers_shrink_with_depth_past_eight_layers() {
        // The measured 8-layer files keep their quarter; all 32 layers of Phi-3-mini take an eighth.
        for (layers, gain) in [(4, 0.25), (8, 0.25), (18, 1.0 / 6.0), (32, 0.125)] {
            let (g, router) = fidelity_sublayer_and_router_gains(Family::Phi3, layers);
            assert!((g - gain).abs() < 1e-7, "{layers} layers: {g}");
            assert_eq!(router, FIDELITY_ROUTER_GAIN);
        }
        // Mixtral's quarter does not depend on depth.
        assert_eq!(fidelity_sublayer_and_router_gains(Family::Mixtral, 32), (0.25, 4.0));
    }

    #[test]
    fn merges_come_between_the_byte_tokens_and_the_special_tokens() {
        let vocabulary = Vocabulary { merges: &["h e", "Ġ t"], size: 270, add_bos: false };
        let metadata = vocabulary.metadata().unwrap();
        assert_eq!(metadata.tokens[256..261], ["he", "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
        assert_eq!((vocabulary.special("<|endoftext|>"), vocabulary.special("<|im_end|>")), (258, 260));
        let tokenizer = crate::tokenize::vocab::byte_level_json(&metadata).unwrap();
        assert_eq!(tokenizer.encode("the", false).unwrap().get_ids(), [u32::from(b't'), 256]);
        assert!(Vocabulary { size: 260, ..vocabulary }.metadata().is_err(), "too small for its named tokens");
    }
}
