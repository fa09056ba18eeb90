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

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::json;

use crate::error::Error;
use crate::tokenize::VocabMetadata;

/// The shape of a llama-family decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Shape {
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: u32,
    /// Llama 3's RoPE scaling (factor 32 from 8192 positions), as Llama 3.2 declares it.
    pub llama3_rope: bool,
    pub tied: bool,
}

/// Shapes of published models, by name.
pub const SHAPES: &[Shape] = &[
    // meta-llama/Llama-3.2-1B: 1.24 B parameters.
    Shape {
        name: "llama-3.2-1b",
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        intermediate: 8192,
        vocab: 128256,
        context: 131072,
        rope_theta: 500000,
        llama3_rope: true,
        tied: true,
    },
    // HuggingFaceTB/SmolLM2-135M-Instruct: the CPU tests' model.
    Shape {
        name: "smollm2-135m",
        hidden: 576,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        intermediate: 1536,
        vocab: 49152,
        context: 8192,
        rope_theta: 100000,
        llama3_rope: false,
        tied: true,
    },
    // A few megabytes, for tests.
    Shape {
        name: "tiny",
        hidden: 128,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate: 256,
        vocab: 512,
        context: 1024,
        rope_theta: 10000,
        llama3_rope: false,
        tied: false,
    },
];

impl Shape {
    pub fn named(name: &str) -> Result<Shape, Error> {
        SHAPES.iter().find(|s| s.name == name).copied().ok_or_else(|| {
            let known = SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ");
            Error::Internal(format!("unknown model shape `{name}` (known: {known})"))
        })
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Parameters, embeddings included (once when tied).
    pub fn parameters(&self) -> usize {
        let (d, kv) = (self.hidden, self.kv_heads * self.head_dim());
        let layer = 2 * d * d + 2 * d * kv + 3 * d * self.intermediate + 2 * d;
        self.vocab * d * if self.tied { 1 } else { 2 } + self.layers * layer + d
    }
}

/// ChatML, the synthetic models' chat template.
const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Uniform values in [-scale, scale) from xorshift64: fast, and the same for a seed on every machine.
struct Random(u64);

impl Random {
    fn tensor(&mut self, dims: &[usize], scale: f32, dtype: DType) -> Result<Tensor, Error> {
        let n: usize = dims.iter().product();
        let mut values = Vec::with_capacity(n);
        for _ in 0..n {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            values.push(((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale);
        }
        let t = Tensor::from_vec(values, dims, &Device::Cpu).and_then(|t| t.to_dtype(dtype));
        t.map_err(|e| Error::Internal(format!("cannot build a random tensor: {e}")))
    }
}

/// The vocabulary: byte tokens (GPT-2's byte-to-character mapping), the special tokens, then fillers.
fn vocabulary(size: usize) -> Result<VocabMetadata, Error> {
    if size < 256 + SPECIALS.len() {
        return Err(Error::Internal(format!("a vocabulary of {size} tokens is smaller than the byte tokens and specials")));
    }
    let mut tokens = Vec::with_capacity(size);
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
    tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
    while tokens.len() < size {
        tokens.push(format!("<|filler_{}|>", tokens.len()));
    }
    let mut token_types = vec![1i32; size];
    token_types[256..256 + SPECIALS.len()].fill(crate::tokenize::vocab::TOKEN_TYPE_CONTROL);
    Ok(VocabMetadata { kind: "gpt2".into(), pre: Some("gpt2".into()), tokens, token_types, ..Default::default() })
}

/// Writes the model in `dir` (written by [`synth_model`]) as `dir/model-<type>.gguf`, its matrices quantized to
/// `quant` (in parallel), norms in f32. Returns the file's path and size.
pub fn synth_gguf(dir: &Path, quant: candle_core::quantized::GgmlDType) -> Result<(std::path::PathBuf, u64), Error> {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::{GgmlDType, QTensor};
    use rayon::prelude::*;
    let fail = |e: &dyn std::fmt::Display| Error::Internal(format!("cannot write a GGUF of `{}`: {e}", dir.display()));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(|e| fail(&e))?).map_err(|e| fail(&e))?;
    let get = |key: &str| config[key].as_u64().map(|v| v as usize).ok_or_else(|| fail(&format!("config.json has no `{key}`")));
    let (d, layers, heads, kv_heads, ffn, vocab, context) = (
        get("hidden_size")?,
        get("num_hidden_layers")?,
        get("num_attention_heads")?,
        get("num_key_value_heads")?,
        get("intermediate_size")?,
        get("vocab_size")?,
        get("max_position_embeddings")?,
    );
    let hd = d / heads;
    let weights = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).map_err(|e| fail(&e))?;
    let tensor = |name: &str| -> Result<Tensor, Error> {
        weights.get(name).ok_or_else(|| fail(&format!("no tensor `{name}`")))?.to_dtype(DType::F32).map_err(|e| fail(&e))
    };
    // Hugging Face rotates halves of each head; GGUF's llama weights are permuted for adjacent pairs.
    let rotary = |name: &str| -> Result<Tensor, Error> {
        crate::engine::models::llama::hf::interleave_halves(&tensor(name)?, hd).map_err(|e| fail(&e))
    };
    let mut dense: Vec<(String, Tensor, GgmlDType)> = Vec::new();
    dense.push(("token_embd.weight".into(), tensor("model.embed_tokens.weight")?, quant));
    dense.push(("output_norm.weight".into(), tensor("model.norm.weight")?, GgmlDType::F32));
    if weights.contains_key("lm_head.weight") {
        dense.push(("output.weight".into(), tensor("lm_head.weight")?, quant));
    }
    for i in 0..layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        dense.push((b("attn_norm"), tensor(&p("input_layernorm.weight"))?, GgmlDType::F32));
        dense.push((b("ffn_norm"), tensor(&p("post_attention_layernorm.weight"))?, GgmlDType::F32));
        dense.push((b("attn_q"), rotary(&p("self_attn.q_proj.weight"))?, quant));
        dense.push((b("attn_k"), rotary(&p("self_attn.k_proj.weight"))?, quant));
        dense.push((b("attn_v"), tensor(&p("self_attn.v_proj.weight"))?, quant));
        dense.push((b("attn_output"), tensor(&p("self_attn.o_proj.weight"))?, quant));
        dense.push((b("ffn_gate"), tensor(&p("mlp.gate_proj.weight"))?, quant));
        dense.push((b("ffn_up"), tensor(&p("mlp.up_proj.weight"))?, quant));
        dense.push((b("ffn_down"), tensor(&p("mlp.down_proj.weight"))?, quant));
    }
    let quantized: Vec<(String, QTensor)> = dense
        .into_par_iter()
        .map(|(name, t, q)| QTensor::quantize(&t, q).map(|t| (name, t)))
        .collect::<candle_core::Result<_>>()
        .map_err(|e| fail(&e))?;
    let vocabulary = vocabulary(vocab)?;
    let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let u32_of = |v: usize| Value::U32(v as u32);
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String(format!("synthetic {}", config["_name_or_path"].as_str().unwrap_or("llama")))),
        ("llama.context_length", u32_of(context)),
        ("llama.embedding_length", u32_of(d)),
        ("llama.block_count", u32_of(layers)),
        ("llama.feed_forward_length", u32_of(ffn)),
        ("llama.attention.head_count", u32_of(heads)),
        ("llama.attention.head_count_kv", u32_of(kv_heads)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(config["rms_norm_eps"].as_f64().unwrap_or(1e-5) as f32)),
        ("llama.rope.freq_base", Value::F32(config["rope_theta"].as_f64().unwrap_or(10_000.0) as f32)),
        ("tokenizer.ggml.model", Value::String(vocabulary.kind.clone())),
        ("tokenizer.ggml.pre", Value::String(vocabulary.pre.clone().unwrap_or_default())),
        ("tokenizer.ggml.tokens", strings(&vocabulary.tokens)),
        ("tokenizer.ggml.token_type", Value::Array(vocabulary.token_types.iter().map(|&t| Value::I32(t)).collect())),
        ("tokenizer.ggml.merges", Value::Array(Vec::new())),
        ("tokenizer.ggml.bos_token_id", Value::U32(256)),
        ("tokenizer.ggml.eos_token_id", Value::U32(258)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        ("tokenizer.chat_template", Value::String(CHATML.into())),
    ];
    let path = dir.join(format!("model-{}.gguf", format!("{quant:?}").to_lowercase()));
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).map_err(|e| fail(&e))?);
    let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = quantized.iter().map(|(k, v)| (k.as_str(), v)).collect();
    candle_core::quantized::gguf_file::write(&mut file, &meta, &tensors).map_err(|e| fail(&e))?;
    std::io::Write::flush(&mut file).map_err(|e| fail(&e))?;
    drop(file);
    let bytes = std::fs::metadata(&path).map_err(|e| fail(&e))?.len();
    Ok((path, bytes))
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
pub fn synth_model(dir: &Path, shape: &Shape, dtype: DType, seed: u64) -> Result<SynthReport, Error> {
    let started = std::time::Instant::now();
    let io = |what: &str, e: &dyn std::fmt::Display| Error::Internal(format!("cannot write {what} in `{}`: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(|e| io("the directory", &e))?;
    let dtype_name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F32 => "float32",
        other => return Err(Error::Internal(format!("synth-model writes bf16, f16 or f32 weights, not {other:?}"))),
    };
    let (bos, eos) = (256u32, 258u32);
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim(),
        "max_position_embeddings": shape.context, "vocab_size": shape.vocab, "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta as f64, "hidden_act": "silu", "tie_word_embeddings": shape.tied,
        "attention_bias": false, "mlp_bias": false, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": dtype_name,
    });
    if shape.llama3_rope {
        config["rope_scaling"] = json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    }
    let write_json = |name: &str, value: &serde_json::Value| {
        std::fs::write(dir.join(name), serde_json::to_string_pretty(value).expect("JSON serialises")).map_err(|e| io(name, &e))
    };
    write_json("config.json", &config)?;
    write_json("generation_config.json", &json!({"bos_token_id": bos, "eos_token_id": eos}))?;
    write_json(
        "tokenizer_config.json",
        &json!({"bos_token": null, "add_bos_token": false, "eos_token": "<|im_end|>", "chat_template": CHATML}),
    )?;
    let tokenizer = crate::tokenize::vocab::build(&vocabulary(shape.vocab)?)?;
    tokenizer.save(dir.join("tokenizer.json"), false).map_err(|e| io("tokenizer.json", &e))?;

    // Weights as Hugging Face initialises them (uniform with about its 0.02 standard deviation; norms 1), so
    // activations keep their scale through the layers.
    let mut rng = Random(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (d, hd) = (shape.hidden, shape.head_dim());
    let (q, kv) = (shape.heads * hd, shape.kv_heads * hd);
    let s = 0.02 * 3f32.sqrt();
    let ones = |n: usize| Tensor::ones(n, dtype, &Device::Cpu).map_err(|e| Error::Internal(e.to_string()));
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("model.embed_tokens.weight".into(), rng.tensor(&[shape.vocab, d], s, dtype)?);
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        tensors.insert(format!("{p}.input_layernorm.weight"), ones(d)?);
        tensors.insert(format!("{p}.post_attention_layernorm.weight"), ones(d)?);
        tensors.insert(format!("{p}.self_attn.q_proj.weight"), rng.tensor(&[q, d], s, dtype)?);
        tensors.insert(format!("{p}.self_attn.k_proj.weight"), rng.tensor(&[kv, d], s, dtype)?);
        tensors.insert(format!("{p}.self_attn.v_proj.weight"), rng.tensor(&[kv, d], s, dtype)?);
        tensors.insert(format!("{p}.self_attn.o_proj.weight"), rng.tensor(&[d, q], s, dtype)?);
        tensors.insert(format!("{p}.mlp.gate_proj.weight"), rng.tensor(&[shape.intermediate, d], s, dtype)?);
        tensors.insert(format!("{p}.mlp.up_proj.weight"), rng.tensor(&[shape.intermediate, d], s, dtype)?);
        tensors.insert(format!("{p}.mlp.down_proj.weight"), rng.tensor(&[d, shape.intermediate], s, dtype)?);
    }
    tensors.insert("model.norm.weight".into(), ones(d)?);
    if !shape.tied {
        tensors.insert("lm_head.weight".into(), rng.tensor(&[shape.vocab, d], s, dtype)?);
    }
    let weights = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &weights).map_err(|e| io("model.safetensors", &e))?;
    let bytes = std::fs::metadata(&weights).map_err(|e| io("model.safetensors", &e))?.len();
    Ok(SynthReport { shape: *shape, dtype: dtype_name.into(), parameters: shape.parameters(), bytes, seconds: started.elapsed().as_secs_f64() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_1b_shape_is_llama_3_2_1b() {
        let s = Shape::named("llama-3.2-1b").unwrap();
        // Llama-3.2-1B's published size: 1,235,814,400 parameters (tied embeddings).
        assert_eq!(s.parameters(), 1_235_814_400);
        assert_eq!(s.head_dim(), 64);
        assert!(Shape::named("gpt-5").unwrap_err().to_string().contains("llama-3.2-1b"));
    }

    #[test]
    fn a_synthetic_model_loads_tokenizes_bytes_and_has_its_shape() {
        let dir = std::env::temp_dir().join(format!("nightshift-synth-{}", std::process::id()));
        let shape = Shape::named("tiny").unwrap();
        let report = synth_model(&dir, &shape, DType::BF16, 7).unwrap();
        assert_eq!(report.parameters, shape.parameters());
        let (model, info) = crate::engine::Model::load(&dir, &Device::Cpu).unwrap();
        assert_eq!((model.config.hidden_size, model.config.layers, model.config.vocab_size), (128, 2, 512));
        assert_eq!(info.vocab.eos, Some(258));
        let tokenizer = crate::tokenize::vocab::build(&info.vocab).unwrap();
        let ids = tokenizer.encode("héllo", false).unwrap().get_ids().to_vec();
        assert_eq!(ids.len(), "héllo".len(), "one token per byte");
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), "héllo");
        // As GGUF: the same function, to quantization (q8_0 here), whichever path loads it.
        let (gguf, _) = synth_gguf(&dir, candle_core::quantized::GgmlDType::Q8_0).unwrap();
        let (quantized, gguf_info) = crate::engine::Model::load(&gguf, &Device::Cpu).unwrap();
        assert_eq!((quantized.config.hidden_size, quantized.config.layers, gguf_info.vocab.eos), (128, 2, Some(258)));
        let tokens: Vec<u32> = "hello, world".bytes().map(u32::from).collect();
        let logits = |m: &crate::engine::Model| {
            use crate::engine::Attention;
            let host = crate::engine::HostAttention::new(m).unwrap();
            let mut cache = host.new_cache(16);
            m.forward(&host, &mut [crate::engine::Segment { tokens: &tokens, cache: &mut cache }]).unwrap().remove(0)
        };
        let (a, b) = (logits(&model), logits(&quantized));
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= 0.05 * scale, "the GGUF computes another function: {diff} of {scale}");
        // The same seed writes the same weights.
        let again = dir.join("again");
        synth_model(&again, &shape, DType::BF16, 7).unwrap();
        assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), std::fs::read(again.join("model.safetensors")).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
