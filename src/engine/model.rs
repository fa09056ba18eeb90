//! The llama-family decoder over GGUF weights, with per-token positions and a KV cache held outside the model.
//!
//! One forward pass takes a list of [`Segment`]s: each is a run of new tokens of one sequence, starting at that
//! sequence's current length. A prefill is a segment of a whole prompt; a decode step is a segment of one token;
//! several of both are packed into one pass, so every weight matrix is read once per step for all of them.
//! Matrix products run on candle's quantized kernels; attention runs over the [`KvCache`] of each sequence in
//! plain Rust, parallel over (segment, head), so sequences of different lengths never need padding or masks.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use rayon::prelude::*;

use super::ModelError;
use crate::tokenize::VocabMetadata;

/// The longest context a model may declare; far beyond today's models, small enough to bound allocations.
const MAX_CONTEXT: usize = 1 << 22;

/// Hyper-parameters of a llama-family decoder, from the model's metadata.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: String,
    pub name: Option<String>,
    pub context_length: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn_size: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub vocab_size: usize,
}

impl ModelConfig {
    /// KV cache bytes one token takes across all layers (f32 keys and values).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }
}

/// What `validate` and `plan` need without loading weights.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub config: ModelConfig,
    pub vocab: VocabMetadata,
    /// Tensor dtypes and how many tensors have each, e.g. `q4_1: 211`.
    pub tensor_types: Vec<(String, usize)>,
}

struct Layer {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    w_gate: QMatMul,
    w_up: QMatMul,
    w_down: QMatMul,
}

pub struct Model {
    pub config: ModelConfig,
    device: Device,
    embedding: Tensor,
    layers: Vec<Layer>,
    output_norm: Tensor,
    lm_head: QMatMul,
    /// cos and sin of position x frequency, `[context_length][head_dim / 2]` each.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
}

/// The keys and values of one sequence, all layers: `[layer][position][kv_head][head_dim]`, grown as the sequence
/// is extended. Capacity is reserved once at admission, so a sequence never reallocates while it decodes.
#[derive(Debug)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    row: usize,
}

impl KvCache {
    pub fn new(config: &ModelConfig, capacity_tokens: usize) -> KvCache {
        let row = config.kv_heads * config.head_dim;
        let alloc = || (0..config.layers).map(|_| Vec::with_capacity(capacity_tokens * row)).collect();
        KvCache { keys: alloc(), values: alloc(), row }
    }

    /// Positions held (the sequence's length so far).
    pub fn len(&self) -> usize {
        self.keys.first().map_or(0, |k| k.len() / self.row)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|v| v.capacity() * std::mem::size_of::<f32>()).sum()
    }
}

/// New tokens of one sequence for one forward pass.
pub struct Segment<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

fn meta<'a>(content: &'a Content, key: &str) -> Result<&'a Value, ModelError> {
    content.metadata.get(key).ok_or_else(|| ModelError::Metadata(format!("missing `{key}`")))
}

fn meta_usize(content: &Content, key: &str) -> Result<usize, ModelError> {
    let v = meta(content, key)?;
    v.to_u64()
        .map(|v| v as usize)
        .or_else(|_| v.to_u32().map(|v| v as usize))
        .or_else(|_| v.to_i32().map(|v| v.max(0) as usize))
        .map_err(|_| ModelError::Metadata(format!("`{key}` is not an integer")))
}

fn meta_f32(content: &Content, key: &str) -> Option<f32> {
    let v = content.metadata.get(key)?;
    v.to_f32().ok().or_else(|| v.to_f64().ok().map(|v| v as f32))
}

fn meta_u32(content: &Content, key: &str) -> Option<u32> {
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

fn read_content(path: &Path) -> Result<(File, Content), ModelError> {
    let mut file = File::open(path).map_err(|source| ModelError::Open { path: path.into(), source })?;
    let content = Content::read(&mut file).map_err(|e| ModelError::Format { path: path.into(), message: e.to_string() })?;
    Ok((file, content))
}

fn info_of(content: &Content) -> Result<ModelInfo, ModelError> {
    let architecture = meta(content, "general.architecture")?
        .to_string()
        .map_err(|_| ModelError::Metadata("`general.architecture` is not a string".into()))?
        .clone();
    if architecture != "llama" {
        return Err(ModelError::Architecture(architecture));
    }
    let a = |k: &str| format!("{architecture}.{k}");
    let hidden_size = meta_usize(content, &a("embedding_length"))?;
    let heads = meta_usize(content, &a("attention.head_count"))?;
    let kv_heads = meta_usize(content, &a("attention.head_count_kv")).unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || hidden_size % heads != 0 || heads % kv_heads != 0 {
        return Err(ModelError::Metadata(format!(
            "inconsistent attention shape: hidden size {hidden_size}, {heads} heads, {kv_heads} kv heads"
        )));
    }
    let head_dim = hidden_size / heads;
    if head_dim % 2 != 0 {
        return Err(ModelError::Metadata(format!("head size {head_dim} is odd")));
    }
    let tokens = meta_strings(content, "tokenizer.ggml.tokens")?;
    let token_types = match content.metadata.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(v) => v
            .to_vec()
            .map_err(|_| ModelError::Metadata("`tokenizer.ggml.token_type` is not an array".into()))?
            .iter()
            .map(|t| t.to_i32().unwrap_or(1))
            .collect(),
    };
    let config = ModelConfig {
        name: content.metadata.get("general.name").and_then(|v| v.to_string().ok().cloned()),
        context_length: meta_usize(content, &a("context_length"))?,
        layers: meta_usize(content, &a("block_count"))?,
        ffn_size: meta_usize(content, &a("feed_forward_length"))?,
        rms_eps: meta_f32(content, &a("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        rope_base: meta_f32(content, &a("rope.freq_base")).unwrap_or(10_000.0),
        vocab_size: tokens.len(),
        hidden_size,
        heads,
        kv_heads,
        head_dim,
        architecture,
    };
    // Bounds that keep a malformed file from asking for absurd allocations (the RoPE table is sized by context).
    if config.context_length == 0 || config.context_length > MAX_CONTEXT || config.layers == 0 || config.layers > 1024 {
        return Err(ModelError::Metadata(format!(
            "context length {} or layer count {} is out of range",
            config.context_length, config.layers
        )));
    }
    let vocab = VocabMetadata {
        kind: content
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok().cloned())
            .ok_or_else(|| ModelError::Metadata("missing `tokenizer.ggml.model`".into()))?,
        pre: content.metadata.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok().cloned()),
        merges: meta_strings(content, "tokenizer.ggml.merges")?,
        bos: meta_u32(content, "tokenizer.ggml.bos_token_id"),
        eos: meta_u32(content, "tokenizer.ggml.eos_token_id"),
        eot: meta_u32(content, "tokenizer.ggml.eot_token_id"),
        add_bos: content.metadata.get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(false),
        chat_template: content.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok().cloned()),
        tokens,
        token_types,
    };
    let mut counts = std::collections::BTreeMap::new();
    for info in content.tensor_infos.values() {
        *counts.entry(format!("{:?}", info.ggml_dtype).to_lowercase()).or_insert(0) += 1;
    }
    Ok(ModelInfo { config, vocab, tensor_types: counts.into_iter().collect() })
}

/// The weight layout matmuls run fastest in on this device. candle's CPU kernels for Q4_0 and Q4_1 are scalar
/// (about 20 GFLOP/s); the same weights as Q8_0 run on its SIMD dot products at about twice that rate, and
/// Q8_0 represents every Q4 value to within half a step of 1/127 of its block's range, far inside the Q4 error.
fn cpu_layout(t: QTensor, device: &Device) -> candle_core::Result<QTensor> {
    use candle_core::quantized::GgmlDType;
    if device.is_cpu() && matches!(t.dtype(), GgmlDType::Q4_0 | GgmlDType::Q4_1) && t.shape().dims().last().is_some_and(|k| k % 32 == 0) {
        QTensor::quantize(&t.dequantize(device)?, GgmlDType::Q8_0)
    } else {
        Ok(t)
    }
}

/// Reads a model file's metadata (architecture, shapes, tokenizer) without loading its weights.
pub fn inspect(path: &Path) -> Result<ModelInfo, ModelError> {
    let (_, content) = read_content(path)?;
    info_of(&content)
}

impl Model {
    /// Loads a GGUF llama-family model onto `device`.
    pub fn load(path: &Path, device: &Device) -> Result<(Model, ModelInfo), ModelError> {
        let (mut file, content) = read_content(path)?;
        let info = info_of(&content)?;
        let config = info.config.clone();
        let fmt = |e: candle_core::Error| ModelError::Format { path: path.into(), message: e.to_string() };
        let mut qtensor = |name: &str| -> Result<QTensor, ModelError> {
            content.tensor(&mut file, name, device).map_err(fmt)
        };
        let expect = |t: &QTensor, name: &str, dims: &[usize]| -> Result<(), ModelError> {
            if t.shape().dims() != dims {
                return Err(ModelError::Metadata(format!(
                    "tensor `{name}` has shape {:?}, expected {dims:?}",
                    t.shape().dims()
                )));
            }
            Ok(())
        };
        let (d, hd) = (config.hidden_size, config.head_dim);
        let embedding_q = qtensor("token_embd.weight")?;
        expect(&embedding_q, "token_embd.weight", &[config.vocab_size, d])?;
        let embedding = embedding_q.dequantize(device).map_err(fmt)?;
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let mut matrix = |suffix: &str, dims: &[usize]| -> Result<QMatMul, ModelError> {
                let name = format!("blk.{i}.{suffix}.weight");
                let t = qtensor(&name)?;
                expect(&t, &name, dims)?;
                QMatMul::from_qtensor(cpu_layout(t, device).map_err(fmt)?).map_err(fmt)
            };
            let wq = matrix("attn_q", &[config.heads * hd, d])?;
            let wk = matrix("attn_k", &[config.kv_heads * hd, d])?;
            let wv = matrix("attn_v", &[config.kv_heads * hd, d])?;
            let wo = matrix("attn_output", &[d, config.heads * hd])?;
            let w_gate = matrix("ffn_gate", &[config.ffn_size, d])?;
            let w_up = matrix("ffn_up", &[config.ffn_size, d])?;
            let w_down = matrix("ffn_down", &[d, config.ffn_size])?;
            let mut norm = |suffix: &str| -> Result<Tensor, ModelError> {
                let name = format!("blk.{i}.{suffix}.weight");
                let t = qtensor(&name)?;
                expect(&t, &name, &[d])?;
                t.dequantize(device).map_err(fmt)
            };
            let attn_norm = norm("attn_norm")?;
            let ffn_norm = norm("ffn_norm")?;
            layers.push(Layer { attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down });
        }
        let output_norm = qtensor("output_norm.weight")?;
        expect(&output_norm, "output_norm.weight", &[d])?;
        let output_norm = output_norm.dequantize(device).map_err(fmt)?;
        // Tied embeddings: without `output.weight`, the embedding matrix is the output projection.
        let lm_head = match content.tensor_infos.contains_key("output.weight") {
            true => {
                let t = qtensor("output.weight")?;
                expect(&t, "output.weight", &[config.vocab_size, d])?;
                t
            }
            false => embedding_q,
        };
        let lm_head = QMatMul::from_qtensor(lm_head).map_err(fmt)?;

        let half = hd / 2;
        let mut rope_cos = Vec::with_capacity(config.context_length * half);
        let mut rope_sin = Vec::with_capacity(config.context_length * half);
        for pos in 0..config.context_length {
            for i in 0..half {
                let freq = 1.0 / (config.rope_base as f64).powf(2.0 * i as f64 / hd as f64);
                let angle = pos as f64 * freq;
                rope_cos.push(angle.cos() as f32);
                rope_sin.push(angle.sin() as f32);
            }
        }
        let model = Model { config, device: device.clone(), embedding, layers, output_norm, lm_head, rope_cos, rope_sin };
        Ok((model, info))
    }

    /// Bytes of weights held on the device (quantized sizes as stored).
    pub fn weight_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let q = |m: &QMatMul| match m {
            QMatMul::QTensor(t) => t.storage_size_in_bytes(),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => dense(t),
        };
        dense(&self.embedding)
            + dense(&self.output_norm)
            + q(&self.lm_head)
            + self
                .layers
                .iter()
                .map(|l| {
                    dense(&l.attn_norm) + dense(&l.ffn_norm) + [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].into_iter().map(q).sum::<usize>()
                })
                .sum::<usize>()
    }

    /// Runs the new tokens of every segment through the model, appending their keys and values to each segment's
    /// cache, and returns the logits after the last token of each segment, `[segments][vocab]`.
    pub fn forward(&self, segments: &mut [Segment<'_>]) -> candle_core::Result<Vec<Vec<f32>>> {
        let cfg = &self.config;
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        for s in segments.iter() {
            let start = s.cache.len();
            if s.tokens.is_empty() || start + s.tokens.len() > cfg.context_length {
                candle_core::bail!("segment of {} tokens at position {start} does not fit the context", s.tokens.len());
            }
            tokens.extend_from_slice(s.tokens);
            positions.extend(start..start + s.tokens.len());
        }
        let n = tokens.len();
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            candle_core::bail!("token id {bad} is outside the vocabulary");
        }
        let ids = Tensor::from_vec(tokens, n, &self.device)?;
        let mut x = self.embedding.index_select(&ids, 0)?;
        let (hd, kv_row) = (cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let mut q = layer.wq.forward(&h)?.flatten_all()?.to_vec1::<f32>()?;
            let mut k = layer.wk.forward(&h)?.flatten_all()?.to_vec1::<f32>()?;
            let v = layer.wv.forward(&h)?.flatten_all()?.to_vec1::<f32>()?;
            for (t, &pos) in positions.iter().enumerate() {
                self.rope(&mut q[t * cfg.heads * hd..(t + 1) * cfg.heads * hd], pos);
                self.rope(&mut k[t * kv_row..(t + 1) * kv_row], pos);
            }
            let mut offset = 0;
            for s in segments.iter_mut() {
                let len = s.tokens.len();
                s.cache.keys[li].extend_from_slice(&k[offset * kv_row..(offset + len) * kv_row]);
                s.cache.values[li].extend_from_slice(&v[offset * kv_row..(offset + len) * kv_row]);
                offset += len;
            }
            let attn = self.attention(li, &q, segments);
            let attn = Tensor::from_vec(attn, (n, cfg.heads * hd), &self.device)?;
            x = (x + layer.wo.forward(&attn)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
            let gate = candle_nn::ops::silu(&layer.w_gate.forward(&h)?)?;
            let ff = layer.w_down.forward(&(gate * layer.w_up.forward(&h)?)?)?;
            x = (x + ff)?;
        }
        let mut last = Vec::with_capacity(segments.len());
        let mut end = 0u32;
        for s in segments.iter() {
            end += s.tokens.len() as u32;
            last.push(end - 1);
        }
        let last = Tensor::from_vec(last, segments.len(), &self.device)?;
        let x = x.index_select(&last, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.output_norm, cfg.rms_eps)?;
        self.lm_head.forward(&x)?.to_dtype(DType::F32)?.to_vec2::<f32>()
    }

    /// Rotary embedding of one token's heads, pairs of adjacent values (GGUF llama weights are permuted for it).
    fn rope(&self, heads: &mut [f32], pos: usize) {
        let half = self.config.head_dim / 2;
        let cos = &self.rope_cos[pos * half..(pos + 1) * half];
        let sin = &self.rope_sin[pos * half..(pos + 1) * half];
        for head in heads.chunks_exact_mut(self.config.head_dim) {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos[i] - b * sin[i];
                head[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// Causal attention of every segment's new queries over its cache, one task per (segment, query head).
    /// Grouped-query attention reads each kv head in place for all the query heads that share it.
    fn attention(&self, layer: usize, q: &[f32], segments: &[Segment<'_>]) -> Vec<f32> {
        let cfg = &self.config;
        let (hd, heads, group) = (cfg.head_dim, cfg.heads, cfg.heads / cfg.kv_heads);
        let kv_row = cfg.kv_heads * hd;
        let q_row = heads * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut starts = Vec::with_capacity(segments.len());
        let mut offset = 0;
        for s in segments {
            starts.push(offset);
            offset += s.tokens.len();
        }
        let tasks: Vec<(usize, usize)> = (0..segments.len()).flat_map(|s| (0..heads).map(move |h| (s, h))).collect();
        let results: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(si, h)| {
                let s = &segments[si];
                let (keys, values) = (&s.cache.keys[layer], &s.cache.values[layer]);
                let total = keys.len() / kv_row;
                let new = s.tokens.len();
                let kv = h / group;
                let mut out = vec![0f32; new * hd];
                let mut scores = Vec::with_capacity(total);
                for t in 0..new {
                    let qv = &q[(starts[si] + t) * q_row + h * hd..][..hd];
                    let visible = total - new + t + 1;
                    scores.clear();
                    let mut max = f32::NEG_INFINITY;
                    for j in 0..visible {
                        let kj = &keys[j * kv_row + kv * hd..][..hd];
                        let dot = qv.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * scale;
                        max = max.max(dot);
                        scores.push(dot);
                    }
                    let mut sum = 0f32;
                    for sc in scores.iter_mut() {
                        *sc = (*sc - max).exp();
                        sum += *sc;
                    }
                    let o = &mut out[t * hd..(t + 1) * hd];
                    for (j, &w) in scores.iter().enumerate() {
                        let vj = &values[j * kv_row + kv * hd..][..hd];
                        let w = w / sum;
                        for (oi, vi) in o.iter_mut().zip(vj) {
                            *oi += w * vi;
                        }
                    }
                }
                out
            })
            .collect();
        let mut attn = vec![0f32; offset * q_row];
        for (&(si, h), out) in tasks.iter().zip(results) {
            for t in 0..segments[si].tokens.len() {
                attn[(starts[si] + t) * q_row + h * hd..][..hd].copy_from_slice(&out[t * hd..(t + 1) * hd]);
            }
        }
        attn
    }
}
