//! The tests' tiny random-weight models: a llama GGUF and Hugging Face directories of every decoder family.

use std::fs::File;
use std::path::Path;

/// Deterministic pseudo-random tensors (xorshift64), uniform in `[-scale, scale]`, for random-weight test models.
pub struct RandomTensors(u64);

impl RandomTensors {
    pub fn new(seed: u64) -> Self {
        RandomTensors(seed | 1)
    }

    pub fn tensor(&mut self, dims: &[usize], scale: f32) -> candle_core::Tensor {
        let n: usize = dims.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        candle_core::Tensor::from_vec(values, dims, &candle_core::Device::Cpu).unwrap()
    }
}

/// ChatML, as the tiny models' chat template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The tiny models' vocabulary: GPT-2's 256 byte tokens, three merges, then `<|endoftext|>`, `<|im_start|>` and
/// `<|im_end|>` as control tokens (ids 259 to 261).
pub struct TinyVocab {
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    /// GGUF token types: 1 normal, 3 control.
    pub token_types: Vec<i32>,
}

pub fn tiny_vocab() -> TinyVocab {
    // GPT-2's byte-to-character mapping: printable bytes map to themselves, the others to U+0100 and up.
    let mut tokens = Vec::new();
    let mut next = 256u32;
    for b in 0u32..256 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        tokens.push(char::from_u32(if printable { b } else { let c = next; next += 1; c }).unwrap().to_string());
    }
    let merges = ["Ġ t", "h e", "Ġ a"];
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    tokens.extend(specials.iter().map(|s| s.to_string()));
    let mut token_types = vec![1i32; tokens.len() - specials.len()];
    token_types.extend([3, 3, 3]);
    TinyVocab { tokens, merges: merges.iter().map(|m| m.to_string()).collect(), token_types }
}

/// A tiny llama model with random weights, written as GGUF (Q8_0 matrices, the layout the real model runs in),
/// with a byte-level BPE vocabulary of the 256 byte tokens, a few merges, ChatML control tokens and a ChatML
/// template. Its outputs are noise, but deterministic: fast for tests of batching, commits and resuming.
pub fn write_tiny_model(path: &Path) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    let (d, layers, heads, kv_heads, ff) = (64usize, 2usize, 4usize, 2usize, 128usize);
    let hd = d / heads;

    let TinyVocab { tokens, merges, token_types: types, .. } = tiny_vocab();
    let eos = tokens.len() as u32 - 3;
    let vocab = tokens.len();

    let mut rng = RandomTensors::new(0x9e3779b97f4a7c15);
    let mut random = |rows: usize, cols: usize, scale: f32| -> Tensor { rng.tensor(&[rows, cols], scale) };
    let q8 = |t: Tensor| QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
    let ones = || QTensor::quantize(&Tensor::ones(d, candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
    let mut tensors: Vec<(String, QTensor)> = vec![("token_embd.weight".into(), q8(random(vocab, d, 1.0)))];
    for i in 0..layers {
        let s = 1.0 / (d as f32).sqrt();
        tensors.push((format!("blk.{i}.attn_q.weight"), q8(random(heads * hd, d, s))));
        tensors.push((format!("blk.{i}.attn_k.weight"), q8(random(kv_heads * hd, d, s))));
        tensors.push((format!("blk.{i}.attn_v.weight"), q8(random(kv_heads * hd, d, s))));
        tensors.push((format!("blk.{i}.attn_output.weight"), q8(random(d, heads * hd, s))));
        tensors.push((format!("blk.{i}.ffn_gate.weight"), q8(random(ff, d, s))));
        tensors.push((format!("blk.{i}.ffn_up.weight"), q8(random(ff, d, s))));
        tensors.push((format!("blk.{i}.ffn_down.weight"), q8(random(d, ff, 1.0 / (ff as f32).sqrt()))));
        tensors.push((format!("blk.{i}.attn_norm.weight"), ones()));
        tensors.push((format!("blk.{i}.ffn_norm.weight"), ones()));
    }
    tensors.push(("output_norm.weight".into(), ones()));
    tensors.push(("output.weight".into(), q8(random(vocab, d, 4.0 / (d as f32).sqrt()))));

    use gguf_file::Value;
    let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("tiny-random".into())),
        ("llama.context_length", Value::U32(256)),
        ("llama.embedding_length", Value::U32(d as u32)),
        ("llama.block_count", Value::U32(layers as u32)),
        ("llama.feed_forward_length", Value::U32(ff as u32)),
        ("llama.attention.head_count", Value::U32(heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(kv_heads as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(&tokens)),
        ("tokenizer.ggml.merges", strings(&merges)),
        ("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.eos_token_id", Value::U32(eos + 2)),
        ("tokenizer.chat_template", Value::String(CHATML_TEMPLATE.into())),
    ];
    let metadata_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::io::BufWriter::new(File::create(path).unwrap());
    gguf_file::write(&mut file, &metadata_refs, &tensor_refs).unwrap();
}

/// The decoder variants of Hugging Face directories the tests write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfVariant {
    /// `llama` with Llama 3's RoPE scaling and a separate output projection; f32.
    Llama3,
    /// `llama` with tied embeddings, as SmolLM; bf16.
    SmolLm,
    /// `mistral` with `head_dim` (48) wider than hidden / heads (32), and a sliding window longer than the
    /// context; f16.
    Mistral,
    /// `qwen2`: q, k and v biases, tied embeddings, a vocabulary larger than the tokenizer's; f32.
    Qwen2,
    /// `qwen3`: per-head q and k RMSNorm, `head_dim` 40, tied embeddings; bf16.
    Qwen3,
}

impl HfVariant {
    pub const ALL: [HfVariant; 5] = [HfVariant::Llama3, HfVariant::SmolLm, HfVariant::Mistral, HfVariant::Qwen2, HfVariant::Qwen3];
}

/// Writes a tiny random-weight Hugging Face decoder directory of one variant: config.json, model.safetensors,
/// tokenizer.json (the byte-level BPE vocabulary of [`tiny_vocab`]), tokenizer_config.json with the ChatML
/// template and generation_config.json. Hidden size 128, 2 layers, 4 heads, 2 kv heads, context 512: every
/// matrix at least 64 wide, as in real models (candle's f32 matmul takes other kernels for narrower outputs).
pub fn write_tiny_hf_model(dir: &Path, variant: HfVariant) {
    use candle_core::{DType, Tensor};
    use std::collections::HashMap;
    std::fs::create_dir_all(dir).unwrap();
    let (d, layers, heads, kv_heads, ff) = (128usize, 2usize, 4usize, 2usize, 256usize);
    let vocab = tiny_vocab();
    let tokenizer_vocab = vocab.tokens.len();
    let vocab_size = if variant == HfVariant::Qwen2 { tokenizer_vocab + 26 } else { tokenizer_vocab };
    let (model_type, head_dim, tied, dtype) = match variant {
        HfVariant::Llama3 => ("llama", d / heads, false, DType::F32),
        HfVariant::SmolLm => ("llama", d / heads, true, DType::BF16),
        HfVariant::Mistral => ("mistral", 48, false, DType::F16),
        HfVariant::Qwen2 => ("qwen2", d / heads, true, DType::F32),
        HfVariant::Qwen3 => ("qwen3", 40, true, DType::BF16),
    };
    let mut config = serde_json::json!({
        "model_type": model_type, "hidden_size": d, "intermediate_size": ff, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 512,
        "vocab_size": vocab_size, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": tied, "bos_token_id": 259, "eos_token_id": 261,
        "torch_dtype": format!("{dtype:?}").to_lowercase(),
    });
    match variant {
        HfVariant::Llama3 => {
            config["rope_theta"] = 500000.0.into();
            // Wavelengths from 6 to 6e5 positions: some kept (< 16), some stretched (> 64), some interpolated.
            config["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
            config["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        }
        HfVariant::SmolLm => config["rope_theta"] = 100000.0.into(),
        HfVariant::Mistral => {
            config["head_dim"] = head_dim.into();
            config["sliding_window"] = 4096.into();
        }
        HfVariant::Qwen2 | HfVariant::Qwen3 => {
            config["sliding_window"] = 4096.into();
            config["use_sliding_window"] = false.into();
            config["max_window_layers"] = layers.into();
            if variant == HfVariant::Qwen3 {
                config["head_dim"] = head_dim.into();
                config["attention_bias"] = false.into();
            }
        }
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();

    let seed = 0x5eed_0000 + variant as u64;
    let mut rng = RandomTensors::new(seed);
    let mut random = |dims: &[usize], scale: f32| -> Tensor { rng.tensor(dims, scale) };
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    let s = 1.0 / (d as f32).sqrt();
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("model.embed_tokens.weight".into(), random(&[vocab_size, d], 1.0));
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        tensors.insert(format!("{p}.input_layernorm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
        tensors.insert(format!("{p}.post_attention_layernorm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
        tensors.insert(format!("{p}.self_attn.q_proj.weight"), random(&[q, d], s));
        tensors.insert(format!("{p}.self_attn.k_proj.weight"), random(&[kv, d], s));
        tensors.insert(format!("{p}.self_attn.v_proj.weight"), random(&[kv, d], s));
        tensors.insert(format!("{p}.self_attn.o_proj.weight"), random(&[d, q], 1.0 / (q as f32).sqrt()));
        if variant == HfVariant::Qwen2 {
            tensors.insert(format!("{p}.self_attn.q_proj.bias"), random(&[q], 0.5));
            tensors.insert(format!("{p}.self_attn.k_proj.bias"), random(&[kv], 0.5));
            tensors.insert(format!("{p}.self_attn.v_proj.bias"), random(&[kv], 0.5));
        }
        if variant == HfVariant::Qwen3 {
            tensors.insert(format!("{p}.self_attn.q_norm.weight"), random(&[head_dim], 0.5).affine(1.0, 1.0).unwrap());
            tensors.insert(format!("{p}.self_attn.k_norm.weight"), random(&[head_dim], 0.5).affine(1.0, 1.0).unwrap());
        }
        tensors.insert(format!("{p}.mlp.gate_proj.weight"), random(&[ff, d], s));
        tensors.insert(format!("{p}.mlp.up_proj.weight"), random(&[ff, d], s));
        tensors.insert(format!("{p}.mlp.down_proj.weight"), random(&[d, ff], 1.0 / (ff as f32).sqrt()));
    }
    tensors.insert("model.norm.weight".into(), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
    if !tied {
        tensors.insert("lm_head.weight".into(), random(&[vocab_size, d], 4.0 * s));
    }
    let tensors: HashMap<String, Tensor> = tensors.into_iter().map(|(k, t)| (k, t.to_dtype(dtype).unwrap())).collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();

    let metadata = nightshift::tokenize::VocabMetadata {
        kind: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens: vocab.tokens,
        token_types: vocab.token_types,
        merges: vocab.merges,
        ..Default::default()
    };
    nightshift::tokenize::vocab::build(&metadata).unwrap().save(dir.join("tokenizer.json"), false).unwrap();
    // Llama 3 style: a BOS added by the tokenizer config; the others start with the template's first token.
    let tokenizer_config = serde_json::json!({
        "bos_token": if variant == HfVariant::Llama3 { serde_json::json!("<|endoftext|>") } else { serde_json::Value::Null },
        "add_bos_token": variant == HfVariant::Llama3,
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": CHATML_TEMPLATE,
    });
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tokenizer_config).unwrap()).unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [261, 259]}"#).unwrap();
}
