//! `synth-model --shape t5-small | flan-t5-small | flan-t5-base`: a random-weight T5 written as a Hugging Face
//! directory (`config.json`, `model.safetensors`, a Unigram `tokenizer.json`) and, with `--gguf`, as the GGUF file
//! llama.cpp's converter writes for it (architecture `t5`, its tensor names and keys), so that nightshift's
//! encoder-decoder can be held against llama.cpp's on the same weights (`tests/seq2seq.rs`,
//! `scripts/fidelity-t5.py`).
//!
//! The weights are drawn peaked, as [`super::Init::Peaked`] draws a decoder's: embeddings in ±1, each matrix in
//! ±1/sqrt(its input width) (the attention's and feed-forward network's output projections a quarter of that:
//! [`SUBLAYER_OUTPUT_GAIN`]), norm weights in 1 ± 0.2, relative-position biases in ±1, and an untied output
//! projection [`super::FIDELITY_OUTPUT_GAIN`] / sqrt(width) wide, so the top token leads by nats rather than by
//! rounding. T5's attention has no 1/sqrt(d) scale, so its scores are peaked without a q/k gain.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use serde_json::json;

use super::{tokenizer_keys, GgufTokenizer, Random};
use crate::error::Error;
use crate::tokenize::gguf::{Metadata, Specials};

/// The attention's and feed-forward network's output projections (`o`, `wo`), over 1/sqrt(their input width). At 1,
/// each of 24 sublayers adds as much to the residual stream as the embedding is, and a quantized file's rounding,
/// summed over all of them, moves the top token of a FLAN-T5-small-shaped model's random logits at 8 % (Q8_0) and 68 %
/// (Q4_K_M) of positions against its f32 copy: llama.cpp and nightshift then agree on only 90 % of each other's
/// tokens on the same file. At a quarter, every layer still shows in the logits (a decoder position bias zeroed moves
/// 15 % of top tokens), and the two agree on 98.6 % (Q8_0 and Q4_K_M) and 100 % (F16) of 512 positions (at an eighth:
/// 99.4 %, 99.0 % and 100 %, the broken bias moving only 7 %). BENCHMARKS.md, "T5 with wider margins".
pub const SUBLAYER_OUTPUT_GAIN: f32 = 0.25;

/// A T5's shape, as its `config.json` states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct T5Shape {
    pub name: &'static str,
    pub vocab: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub heads: usize,
    pub d_ff: usize,
    pub layers: usize,
    pub decoder_layers: usize,
    /// T5 v1.1 and FLAN-T5: gated-GELU feed-forward layers and an output projection of its own; the original T5:
    /// ReLU and the output tied to the embeddings (its logits scaled by `d_model^-0.5`).
    pub gated: bool,
    pub buckets: usize,
}

/// The published shapes (their `config.json`).
pub const T5_SHAPES: [T5Shape; 3] = [
    T5Shape { name: "t5-small", vocab: 32128, d_model: 512, d_kv: 64, heads: 8, d_ff: 2048, layers: 6, decoder_layers: 6, gated: false, buckets: 32 },
    T5Shape { name: "flan-t5-small", vocab: 32128, d_model: 512, d_kv: 64, heads: 6, d_ff: 1024, layers: 8, decoder_layers: 8, gated: true, buckets: 32 },
    T5Shape { name: "flan-t5-base", vocab: 32128, d_model: 768, d_kv: 64, heads: 12, d_ff: 2048, layers: 12, decoder_layers: 12, gated: true, buckets: 32 },
];

impl T5Shape {
    pub fn named(name: &str) -> Option<T5Shape> {
        T5_SHAPES.iter().find(|s| s.name == name).copied()
    }

    pub fn parameters(&self) -> usize {
        let (d, inner, ff) = (self.d_model, self.heads * self.d_kv, self.d_ff);
        let attention = 4 * d * inner + d;
        let feed = if self.gated { 3 } else { 2 } * d * ff + d;
        let head = if self.gated { self.vocab * d } else { 0 };
        self.vocab * d + self.layers * (attention + feed) + self.decoder_layers * (2 * attention + feed) + 2 * self.buckets * self.heads + 2 * d + head
    }
}

/// What was written.
#[derive(Debug, serde::Serialize)]
pub struct T5Report {
    pub shape: T5Shape,
    pub parameters: usize,
    pub bytes: u64,
}

/// A SentencePiece Unigram vocabulary of `size` pieces laid out as T5's (`<pad>` 0, `</s>` 1, `<unk>` 2), its
/// pieces `▁w0`, `▁w1`, ... for tests and shapes that need no real text: the same vocabulary as a `tokenizer.json`
/// ([`unigram_tokenizer_json`]) and as GGUF keys ([`gguf_vocabulary`]).
fn pieces(size: usize) -> Vec<(String, f64)> {
    let mut out = vec![("<pad>".to_string(), 0.0), ("</s>".to_string(), 0.0), ("<unk>".to_string(), 0.0)];
    out.extend((3..size).map(|i| (format!("\u{2581}w{}", i - 3), -1.0 - (i - 3) as f64 / size as f64)));
    out
}

/// A Unigram vocabulary of `pieces` and their scores, laid out as T5's (`<pad>` 0, `</s>` 1, `<unk>` 2 first), as a
/// `tokenizer.json` as T5's: Metaspace splitting and decoding, `</s>` appended, text lowercased first where asked.
pub fn unigram_tokenizer_json(pieces: &[(String, f64)], lowercase: bool) -> serde_json::Value {
    let special = |id: usize, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let metaspace = json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<pad>"), special(1, "</s>"), special(2, "<unk>")],
        "normalizer": if lowercase { json!({"type": "Lowercase"}) } else { serde_json::Value::Null },
        "pre_tokenizer": metaspace,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": "</s>", "type_id": 1}}],
            "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}
        },
        "decoder": metaspace,
        "model": {"type": "Unigram", "unk_id": 2, "vocab": pieces.iter().map(|(p, s)| json!([p, s])).collect::<Vec<_>>(), "byte_fallback": false}
    })
}

/// [`pieces`] as a GGUF vocabulary, as llama.cpp's converter writes T5's (`t5` model, `</s>` added at the end, a
/// space prefix).
pub fn gguf_vocabulary(size: usize) -> GgufTokenizer {
    let pieces = pieces(size);
    let meta = Metadata {
        model: "t5".into(),
        pre: Some("default".into()),
        tokens: pieces.iter().map(|(p, _)| p.clone()).collect(),
        scores: Some(pieces.iter().map(|(_, s)| *s as f32).collect()),
        // llama.cpp's token types: 3 control, 2 unknown, 1 normal.
        token_types: Some((0..size).map(|i| match i { 0 | 1 => 3, 2 => 2, _ => 1 }).collect()),
        merges: None,
        precompiled_charsmap: None,
        ids: Specials { eos: Some(1), unknown: Some(2), padding: Some(0), ..Specials::default() },
        add_bos: Some(false),
        add_eos: Some(true),
        add_sep: None,
        add_space_prefix: Some(true),
        remove_extra_whitespaces: Some(true),
        lowercase: None,
        strip_accents: None,
        name: None,
        architecture: Some("t5".into()),
    };
    GgufTokenizer::From(Box::new(meta), None)
}

/// Writes a random-weight T5 of `shape` into `dir` (created if needed): `config.json`, `model.safetensors` (f32)
/// and, `with_tokenizer`, the [`pieces`] vocabulary's `tokenizer.json` (left out for a shape sized to a GGUF
/// vocabulary, which has no `tokenizer.json`).
pub fn write_t5(dir: &Path, shape: &T5Shape, seed: u64, with_tokenizer: bool) -> Result<T5Report, Error> {
    let fail = |e: &dyn std::fmt::Display| Error::Internal(format!("cannot write a T5 into `{}`: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
    let (d, dk, heads, ff) = (shape.d_model, shape.d_kv, shape.heads, shape.d_ff);
    let inner = dk * heads;
    let config = json!({
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": shape.vocab, "d_model": d,
        "d_kv": dk, "d_ff": ff, "num_layers": shape.layers, "num_decoder_layers": shape.decoder_layers, "num_heads": heads,
        "relative_attention_num_buckets": shape.buckets, "relative_attention_max_distance": 128, "dropout_rate": 0.0,
        "layer_norm_epsilon": 1e-6, "initializer_factor": 1.0, "feed_forward_proj": if shape.gated { "gated-gelu" } else { "relu" },
        "tie_word_embeddings": !shape.gated, "is_encoder_decoder": true, "pad_token_id": 0, "eos_token_id": 1,
        "decoder_start_token_id": 0, "n_positions": 512
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).map_err(|e| fail(&e))?).map_err(|e| fail(&e))?;
    let mut rng = Random::new(seed);
    let mut draw = |dims: &[usize], scale: f32| rng.tensor(dims, scale);
    let norm = |t: Tensor| t.affine(1.0, 1.0).map_err(|e| fail(&e));
    let s = 1.0 / (d as f32).sqrt();
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("shared.weight".into(), draw(&[shape.vocab, d], 1.0)?);
    for (stack, layers, decoder) in [("encoder", shape.layers, false), ("decoder", shape.decoder_layers, true)] {
        for i in 0..layers {
            let p = format!("{stack}.block.{i}.layer");
            let mut attention = |name: String, tensors: &mut HashMap<String, Tensor>| -> Result<(), Error> {
                for w in ["q", "k", "v"] {
                    tensors.insert(format!("{name}.{w}.weight"), draw(&[inner, d], s)?);
                }
                tensors.insert(format!("{name}.o.weight"), draw(&[d, inner], SUBLAYER_OUTPUT_GAIN / (inner as f32).sqrt())?);
                Ok(())
            };
            attention(format!("{p}.0.SelfAttention"), &mut tensors)?;
            if decoder {
                attention(format!("{p}.1.EncDecAttention"), &mut tensors)?;
            }
            let f = if decoder { 2 } else { 1 };
            let wi = if shape.gated { vec!["wi_0", "wi_1"] } else { vec!["wi"] };
            for w in wi {
                tensors.insert(format!("{p}.{f}.DenseReluDense.{w}.weight"), draw(&[ff, d], s)?);
            }
            tensors.insert(format!("{p}.{f}.DenseReluDense.wo.weight"), draw(&[d, ff], SUBLAYER_OUTPUT_GAIN / (ff as f32).sqrt())?);
            for n in 0..=f {
                tensors.insert(format!("{p}.{n}.layer_norm.weight"), norm(draw(&[d], 0.2)?)?);
            }
        }
        tensors.insert(format!("{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"), draw(&[shape.buckets, heads], 1.0)?);
        tensors.insert(format!("{stack}.final_layer_norm.weight"), norm(draw(&[d], 0.2)?)?);
    }
    if shape.gated {
        tensors.insert("lm_head.weight".into(), draw(&[shape.vocab, d], super::FIDELITY_OUTPUT_GAIN * s)?);
    }
    let weights = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &weights).map_err(|e| fail(&e))?;
    if with_tokenizer {
        std::fs::write(dir.join("tokenizer.json"), unigram_tokenizer_json(&pieces(shape.vocab), false).to_string()).map_err(|e| fail(&e))?;
    }
    let bytes = std::fs::metadata(&weights).map_err(|e| fail(&e))?.len();
    Ok(T5Report { shape: *shape, parameters: shape.parameters(), bytes })
}

/// llama.cpp's name of a tensor of Hugging Face's T5 (its converter's map), `None` for the embeddings' other copies.
fn gguf_name(name: &str) -> Option<String> {
    match name {
        "shared.weight" => return Some("token_embd.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        "encoder.final_layer_norm.weight" => return Some("enc.output_norm.weight".into()),
        "decoder.final_layer_norm.weight" => return Some("dec.output_norm.weight".into()),
        _ => {}
    }
    let (stack, rest) = name.split_once(".block.")?;
    let s = match stack {
        "encoder" => "enc",
        "decoder" => "dec",
        _ => return None,
    };
    let (layer, rest) = rest.split_once(".layer.")?;
    let (sub, part) = rest.split_once('.')?;
    let ffn = if s == "dec" { "2" } else { "1" };
    let tail = match (sub, part) {
        ("0", "layer_norm.weight") => "attn_norm",
        ("0", "SelfAttention.relative_attention_bias.weight") => "attn_rel_b",
        ("0", p) if p.starts_with("SelfAttention.") => match p {
            "SelfAttention.q.weight" => "attn_q",
            "SelfAttention.k.weight" => "attn_k",
            "SelfAttention.v.weight" => "attn_v",
            "SelfAttention.o.weight" => "attn_o",
            _ => return None,
        },
        ("1", "layer_norm.weight") if s == "dec" => "cross_attn_norm",
        ("1", p) if s == "dec" && p.starts_with("EncDecAttention.") => match p {
            "EncDecAttention.q.weight" => "cross_attn_q",
            "EncDecAttention.k.weight" => "cross_attn_k",
            "EncDecAttention.v.weight" => "cross_attn_v",
            "EncDecAttention.o.weight" => "cross_attn_o",
            _ => return None,
        },
        (f, "layer_norm.weight") if f == ffn => "ffn_norm",
        (f, "DenseReluDense.wi.weight" | "DenseReluDense.wi_1.weight") if f == ffn => "ffn_up",
        (f, "DenseReluDense.wi_0.weight") if f == ffn => "ffn_gate",
        (f, "DenseReluDense.wo.weight") if f == ffn => "ffn_down",
        _ => return None,
    };
    Some(format!("{s}.blk.{layer}.{tail}.weight"))
}

/// Writes the T5 in `dir` (written by [`write_t5`], or any Hugging Face T5 with `config.json` and
/// `model.safetensors`) as `dir/model-<type>.gguf`, as llama.cpp's converter does: its tensors renamed, matrices
/// (the embeddings too) in `quant`, norms and relative-position biases in f32, and `tokenizer`'s keys (by default
/// [`gguf_vocabulary`] of the model's size). Returns the file's path and size.
pub fn t5_gguf(dir: &Path, quant: GgmlDType, tokenizer: Option<&GgufTokenizer>) -> Result<(PathBuf, u64), Error> {
    let fail = |e: &dyn std::fmt::Display| Error::Internal(format!("cannot write a GGUF of `{}`: {e}", dir.display()));
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(|e| fail(&e))?).map_err(|e| fail(&e))?;
    let get = |key: &str| config[key].as_u64().map(|v| v as u32).ok_or_else(|| fail(&format!("config.json has no `{key}`")));
    let vocab = get("vocab_size")? as usize;
    let tokenizer = tokenizer.cloned().unwrap_or_else(|| gguf_vocabulary(vocab));
    if tokenizer.size() != vocab {
        return Err(fail(&format!("a vocabulary of {} tokens for an embedding of {vocab} rows", tokenizer.size())));
    }
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).map_err(|e| fail(&e))?;
    let mut dense: Vec<(String, Tensor, GgmlDType)> = Vec::new();
    for (name, t) in &tensors {
        let Some(gguf) = gguf_name(name) else { continue };
        let t = t.to_dtype(DType::F32).map_err(|e| fail(&e))?;
        let matrix = t.rank() == 2 && !gguf.ends_with("attn_rel_b.weight");
        dense.push((gguf, t, if matrix { quant } else { GgmlDType::F32 }));
    }
    dense.sort_by(|a, b| a.0.cmp(&b.0));
    let eps = config["layer_norm_epsilon"].as_f64().unwrap_or(1e-6) as f32;
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("t5".into())),
        ("general.name".into(), Value::String(format!("synthetic {}", dir.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()))),
        ("t5.context_length".into(), Value::U32(config["n_positions"].as_u64().unwrap_or(512) as u32)),
        ("t5.embedding_length".into(), Value::U32(get("d_model")?)),
        ("t5.feed_forward_length".into(), Value::U32(get("d_ff")?)),
        ("t5.block_count".into(), Value::U32(get("num_layers")?)),
        ("t5.decoder_block_count".into(), Value::U32(config["num_decoder_layers"].as_u64().map_or(get("num_layers")?, |n| n as u32))),
        ("t5.attention.head_count".into(), Value::U32(get("num_heads")?)),
        ("t5.attention.key_length".into(), Value::U32(get("d_kv")?)),
        ("t5.attention.value_length".into(), Value::U32(get("d_kv")?)),
        ("t5.attention.layer_norm_epsilon".into(), Value::F32(eps)),
        ("t5.attention.layer_norm_rms_epsilon".into(), Value::F32(eps)),
        ("t5.attention.relative_buckets_count".into(), Value::U32(get("relative_attention_num_buckets")?)),
        ("t5.decoder_start_token_id".into(), Value::U32(get("decoder_start_token_id")?)),
    ];
    // No chat template: a seq2seq model reads its source as it is.
    metadata.extend(tokenizer_keys(&tokenizer)?.into_iter().filter(|(k, _)| k != "tokenizer.chat_template"));
    let path = dir.join(format!("model-{}.gguf", format!("{quant:?}").to_lowercase()));
    let bytes = super::write_gguf_tensors(&path, &metadata, dense)?;
    Ok((path, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tensor_of_a_t5_has_a_gguf_name_that_reads_back() {
        let dir = std::env::temp_dir().join(format!("nightshift-synth-t5-{}", std::process::id()));
        let shape = T5Shape { name: "tiny", vocab: 40, d_model: 16, d_kv: 4, heads: 2, d_ff: 32, layers: 2, decoder_layers: 3, gated: true, buckets: 8 };
        write_t5(&dir, &shape, 7, true).unwrap();
        let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
        let count: usize = tensors.values().map(|t| t.elem_count()).sum();
        assert_eq!(count, shape.parameters());
        for name in tensors.keys() {
            assert!(gguf_name(name).is_some(), "{name}");
        }
        let (path, _) = t5_gguf(&dir, GgmlDType::F32, None).unwrap();
        let mut file = std::fs::File::open(&path).unwrap();
        let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
        assert_eq!(content.tensor_infos.len(), tensors.len());
        assert!(content.tensor_infos.contains_key("dec.blk.2.cross_attn_o.weight"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
