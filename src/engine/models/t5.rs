//! The T5 encoder-decoder over Hugging Face safetensors weights.
//!
//! The encoder runs once per request, on a padded batch with an attention mask (padded keys get minus-infinity
//! scores). The decoder runs one token per sequence per step: its projections and feed-forward layers are batched
//! across sequences, while attention runs in plain Rust over each sequence's own self-attention cache and over the
//! cross-attention keys and values computed once from that sequence's encoder output.
//!
//! T5 details: RMS-style layer norm without bias or mean, attention without the 1/sqrt(d) scale, a learned
//! relative-position bias from the first layer shared by all layers (bidirectional buckets in the encoder,
//! causal ones in the decoder), and output logits scaled by d_model^-0.5 when embeddings are tied.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use crate::engine::ModelError;

#[derive(Clone, Debug, Deserialize)]
pub struct T5Config {
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    #[serde(default)]
    pub num_decoder_layers: Option<usize>,
    pub num_heads: usize,
    #[serde(default = "default_buckets")]
    pub relative_attention_num_buckets: usize,
    #[serde(default = "default_max_distance")]
    pub relative_attention_max_distance: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_ff")]
    pub feed_forward_proj: String,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub pad_token_id: usize,
    #[serde(default = "default_eos")]
    pub eos_token_id: usize,
    #[serde(default)]
    pub decoder_start_token_id: Option<usize>,
    #[serde(default)]
    pub model_type: Option<String>,
}

fn default_buckets() -> usize {
    32
}
fn default_max_distance() -> usize {
    128
}
fn default_eps() -> f64 {
    1e-6
}
fn default_ff() -> String {
    "relu".into()
}
fn default_true() -> bool {
    true
}
fn default_eos() -> usize {
    1
}

impl T5Config {
    pub fn decoder_layers(&self) -> usize {
        self.num_decoder_layers.unwrap_or(self.num_layers)
    }

    pub fn decoder_start(&self) -> u32 {
        self.decoder_start_token_id.unwrap_or(self.pad_token_id) as u32
    }

    fn inner(&self) -> usize {
        self.num_heads * self.d_kv
    }
}

/// T5's relative-position bucket of `relative = key position - query position` (Hugging Face's rule).
pub fn relative_bucket(relative: i64, bidirectional: bool, num_buckets: usize, max_distance: usize) -> usize {
    let mut buckets = num_buckets as i64;
    let mut base = 0i64;
    let distance = if bidirectional {
        buckets /= 2;
        if relative > 0 {
            base = buckets;
        }
        relative.abs()
    } else {
        (-relative).max(0)
    };
    let max_exact = buckets / 2;
    if distance < max_exact {
        return (base + distance) as usize;
    }
    let large = max_exact
        + ((distance as f64 / max_exact as f64).ln() / (max_distance as f64 / max_exact as f64).ln() * (buckets - max_exact) as f64)
            as i64;
    (base + large.min(buckets - 1)) as usize
}

enum FeedForward {
    Relu { wi: Tensor, wo: Tensor },
    GatedGelu { wi0: Tensor, wi1: Tensor, wo: Tensor },
}

impl FeedForward {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            FeedForward::Relu { wi, wo } => x.matmul(&wi.t()?)?.relu()?.matmul(&wo.t()?),
            FeedForward::GatedGelu { wi0, wi1, wo } => {
                let gate = x.matmul(&wi0.t()?)?.gelu()?;
                (gate * x.matmul(&wi1.t()?)?)?.matmul(&wo.t()?)
            }
        }
    }
}

/// q, k, v: `[inner, d_model]`; o: `[d_model, inner]`.
struct Attention {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
}

struct Block {
    self_attention: Attention,
    self_norm: Tensor,
    /// Decoder blocks only.
    cross: Option<(Attention, Tensor)>,
    ff: FeedForward,
    ff_norm: Tensor,
}

pub struct T5 {
    pub config: T5Config,
    device: Device,
    shared: Tensor,
    encoder: Vec<Block>,
    encoder_norm: Tensor,
    encoder_bias: Tensor,
    decoder: Vec<Block>,
    decoder_norm: Tensor,
    /// `[buckets][heads]`, read per position in the decoder's plain-Rust attention.
    decoder_bias: Vec<f32>,
    /// Position buckets, computed at load time. Every distance at or beyond `relative_attention_max_distance`
    /// falls in the last bucket, so distances are clamped to it. Encoder: by `relative + max_distance` for
    /// relative in `-max_distance..=max_distance`; decoder: by how far back the key is, `0..=max_distance`.
    encoder_buckets: Vec<u32>,
    decoder_buckets: Vec<usize>,
    lm_head: Tensor,
    logit_scale: f64,
    /// Whether the stored weights were in another type than f32 (16-bit safetensors, a quantized or F16 GGUF),
    /// widened to f32 at load: the metrics' `weights_layout` says so.
    widened: bool,
}

/// What a sequence keeps between decoder steps: per layer, its self-attention keys and values so far, and the
/// cross-attention keys and values of its encoder output (`[positions][inner]`, flattened).
pub struct DecoderState {
    self_keys: Vec<Vec<f32>>,
    self_values: Vec<Vec<f32>>,
    cross_keys: Vec<Vec<f32>>,
    cross_values: Vec<Vec<f32>>,
    /// Decoder positions so far.
    pub len: usize,
}

impl DecoderState {
    pub fn bytes(&self) -> usize {
        [&self.self_keys, &self.self_values, &self.cross_keys, &self.cross_values]
            .iter()
            .flat_map(|v| v.iter())
            .map(|v| v.capacity() * 4)
            .sum()
    }
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let variance = x.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
    x.broadcast_div(&(variance + eps)?.sqrt()?)?.broadcast_mul(weight)
}

fn softmax_in_place(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in scores.iter_mut() {
        *s /= sum;
    }
}

/// One query (all heads, `[heads * d_kv]`) against the cached positions (`keys` and `values`, `[positions, heads *
/// d_kv]`); `bias(head, position)` is added to each score. Writes the attended values, `[heads * d_kv]`.
fn attend(q: &[f32], keys: &[f32], values: &[f32], heads: usize, d_kv: usize, bias: impl Fn(usize, usize) -> f32, out: &mut [f32]) {
    let inner = heads * d_kv;
    let n = keys.len() / inner;
    let mut scores = vec![0f32; n];
    for h in 0..heads {
        let qh = &q[h * d_kv..(h + 1) * d_kv];
        for (p, score) in scores.iter_mut().enumerate() {
            let k = &keys[p * inner + h * d_kv..p * inner + (h + 1) * d_kv];
            *score = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() + bias(h, p);
        }
        softmax_in_place(&mut scores);
        let oh = &mut out[h * d_kv..(h + 1) * d_kv];
        oh.fill(0.0);
        for (p, &w) in scores.iter().enumerate() {
            let v = &values[p * inner + h * d_kv..p * inner + (h + 1) * d_kv];
            for (o, x) in oh.iter_mut().zip(v) {
                *o += w * x;
            }
        }
    }
}

/// The shape checks every T5 passes before its weights are read, whatever its file.
fn check(c: &T5Config) -> Result<(), ModelError> {
    if c.num_heads == 0 || c.d_kv == 0 || c.d_model == 0 || c.d_ff == 0 || c.vocab_size == 0 || c.num_layers == 0 || c.num_layers > 256 || c.decoder_layers() == 0 || c.decoder_layers() > 256 || c.relative_attention_num_buckets < 4
        || c.relative_attention_max_distance <= c.relative_attention_num_buckets / 2
        || c.relative_attention_max_distance > 1 << 16
    {
        return Err(ModelError::Metadata(format!(
            "inconsistent T5 shape: {} heads, d_kv {}, {} layers, {} position buckets up to distance {}",
            c.num_heads, c.d_kv, c.num_layers, c.relative_attention_num_buckets, c.relative_attention_max_distance
        )));
    }
    // Bounds far above any published T5 (11B: d_model 1,024, d_ff 65,536, 128 heads, 32,128 tokens), so that
    // shapes read from a file multiply without overflow.
    if c.num_heads > 1024 || c.d_kv > 1 << 16 || c.d_model > 1 << 20 || c.d_ff > 1 << 24 || c.vocab_size > 1 << 24 {
        return Err(ModelError::Metadata(format!(
            "implausible T5 shape: d_model {}, {} heads of {}, d_ff {}, vocabulary {}",
            c.d_model, c.num_heads, c.d_kv, c.d_ff, c.vocab_size
        )));
    }
    if !matches!(c.feed_forward_proj.as_str(), "relu" | "gated-gelu") {
        return Err(ModelError::Metadata(format!("feed_forward_proj `{}` is not supported (relu, gated-gelu)", c.feed_forward_proj)));
    }
    Ok(())
}

impl T5 {
    /// Reads and checks `config.json` without loading weights: the architecture, the shapes and the feed-forward
    /// type, as [`T5::load`] checks them (`validate` and `run` accept the same models).
    pub fn inspect(path: &Path) -> Result<T5Config, ModelError> {
        if path.is_file() {
            let (_, content) = crate::engine::models::llama::gguf::read_content(path)?;
            return gguf::config(&content);
        }
        let config_path = path.join("config.json");
        let config: T5Config = match std::fs::read(&config_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| ModelError::File { path: config_path.clone(), message: e.to_string() })?,
            Err(source) => return Err(ModelError::Open { path: config_path, source }),
        };
        if let Some(kind) = config.model_type.as_deref().filter(|k| *k != "t5") {
            return Err(ModelError::Architecture { name: kind.to_string(), supported: "t5 for seq2seq jobs" });
        }
        check(&config)?;
        Ok(config)
    }

    /// Loads a Hugging Face directory (`config.json`, `model.safetensors`) or a GGUF file ([`T5::load_gguf`]).
    pub fn load(path: &Path, device: &Device) -> Result<T5, ModelError> {
        if path.is_file() {
            return T5::load_gguf(path, device);
        }
        let config = T5::inspect(path)?;
        let file = path.join("model.safetensors");
        let fmt = |e: candle_core::Error| ModelError::File { path: file.clone(), message: crate::engine::first_line(&e) };
        let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&file, device).map_err(|e| match file.exists() {
            true => fmt(e),
            false => ModelError::Open { path: file.clone(), source: std::io::ErrorKind::NotFound.into() },
        })?;
        let widened = tensors.values().any(|t| t.dtype() != DType::F32);
        T5::from_tensors(config, tensors, device, widened)
    }

    /// Loads a GGUF file of llama.cpp's `t5` architecture (as its converter writes T5, T5 v1.1 and FLAN-T5): its
    /// tensors renamed to Hugging Face's and dequantized to f32, the precision this engine computes T5 in (widened,
    /// never narrowed). A file without `output.weight` ties the head to the embeddings, and its logits are scaled by
    /// `d_model^-0.5` as Hugging Face's T5 scales them (llama.cpp does not).
    pub fn load_gguf(path: &Path, device: &Device) -> Result<T5, ModelError> {
        let (mut file, content) = crate::engine::models::llama::gguf::read_content(path)?;
        let config = gguf::config(&content)?;
        let tensors = gguf::tensors(&mut file, &content, &config, device)
            .map_err(|e| ModelError::File { path: path.into(), message: crate::engine::first_line(&e) })??;
        let widened = content.tensor_infos.values().any(|t| t.ggml_dtype != candle_core::quantized::GgmlDType::F32);
        T5::from_tensors(config, tensors, device, widened)
    }

    /// The model from its tensors under Hugging Face's names, in any float type (computed in f32).
    fn from_tensors(config: T5Config, mut tensors: HashMap<String, Tensor>, device: &Device, widened: bool) -> Result<T5, ModelError> {
        let c = &config;
        let mut take = |name: &str, dims: &[usize]| -> Result<Tensor, ModelError> {
            let t = tensors.remove(name).ok_or_else(|| ModelError::Metadata(format!("tensor `{name}` is missing")))?;
            if t.dims() != dims {
                return Err(ModelError::Metadata(format!("tensor `{name}` has shape {:?}, expected {dims:?}", t.dims())));
            }
            t.to_dtype(DType::F32).map_err(|e| ModelError::Metadata(e.to_string()))
        };
        let (d, inner, ff, buckets, heads) = (c.d_model, c.inner(), c.d_ff, c.relative_attention_num_buckets, c.num_heads);
        let gated = c.feed_forward_proj == "gated-gelu";
        let shared = take("shared.weight", &[c.vocab_size, d])?;
        let mut stack = |prefix: &str, layers: usize, decoder: bool| -> Result<(Vec<Block>, Tensor, Tensor), ModelError> {
            let mut blocks = Vec::with_capacity(layers);
            for i in 0..layers {
                let p = format!("{prefix}.block.{i}.layer");
                let mut attention = |name: &str| -> Result<Attention, ModelError> {
                    Ok(Attention {
                        q: take(&format!("{name}.q.weight"), &[inner, d])?,
                        k: take(&format!("{name}.k.weight"), &[inner, d])?,
                        v: take(&format!("{name}.v.weight"), &[inner, d])?,
                        o: take(&format!("{name}.o.weight"), &[d, inner])?,
                    })
                };
                let self_attention = attention(&format!("{p}.0.SelfAttention"))?;
                let cross = match decoder {
                    true => Some((attention(&format!("{p}.1.EncDecAttention"))?, take(&format!("{p}.1.layer_norm.weight"), &[d])?)),
                    false => None,
                };
                let f = if decoder { 2 } else { 1 };
                let ff_prefix = format!("{p}.{f}.DenseReluDense");
                let feed = match gated {
                    false => FeedForward::Relu { wi: take(&format!("{ff_prefix}.wi.weight"), &[ff, d])?, wo: take(&format!("{ff_prefix}.wo.weight"), &[d, ff])? },
                    true => FeedForward::GatedGelu {
                        wi0: take(&format!("{ff_prefix}.wi_0.weight"), &[ff, d])?,
                        wi1: take(&format!("{ff_prefix}.wi_1.weight"), &[ff, d])?,
                        wo: take(&format!("{ff_prefix}.wo.weight"), &[d, ff])?,
                    },
                };
                blocks.push(Block {
                    self_attention,
                    self_norm: take(&format!("{p}.0.layer_norm.weight"), &[d])?,
                    cross,
                    ff: feed,
                    ff_norm: take(&format!("{p}.{f}.layer_norm.weight"), &[d])?,
                });
            }
            let bias = take(&format!("{prefix}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"), &[buckets, heads])?;
            let norm = take(&format!("{prefix}.final_layer_norm.weight"), &[d])?;
            Ok((blocks, norm, bias))
        };
        let (encoder, encoder_norm, encoder_bias) = stack("encoder", c.num_layers, false)?;
        let (decoder, decoder_norm, decoder_bias) = stack("decoder", c.decoder_layers(), true)?;
        let lm_head = match c.tie_word_embeddings {
            true => shared.clone(),
            false => take("lm_head.weight", &[c.vocab_size, d])?,
        };
        let decoder_bias = decoder_bias.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| ModelError::Metadata(e.to_string()))?;
        let logit_scale = if c.tie_word_embeddings { (d as f64).powf(-0.5) } else { 1.0 };
        let (max, n) = (c.relative_attention_max_distance as i64, c.relative_attention_num_buckets);
        let encoder_buckets = (-max..=max).map(|r| relative_bucket(r, true, n, max as usize) as u32).collect();
        let decoder_buckets = (0..=max).map(|back| relative_bucket(-back, false, n, max as usize)).collect();
        Ok(T5 {
            device: device.clone(),
            shared,
            encoder,
            encoder_norm,
            encoder_bias,
            decoder,
            decoder_norm,
            decoder_bias,
            encoder_buckets,
            decoder_buckets,
            lm_head,
            logit_scale,
            widened,
            config,
        })
    }

    /// Encodes a padded batch; returns each row's encoder output, `[row length, d_model]`.
    pub fn encode(&self, rows: &[&[u32]]) -> candle_core::Result<Vec<Tensor>> {
        let c = &self.config;
        let (b, l, d, h, dk) = (rows.len(), rows.iter().map(|r| r.len()).max().unwrap_or(0), c.d_model, c.num_heads, c.d_kv);
        if rows.iter().flat_map(|r| r.iter()).any(|&id| id as usize >= c.vocab_size) {
            candle_core::bail!("a token id is outside the vocabulary of {}", c.vocab_size);
        }
        let mut ids = Vec::with_capacity(b * l);
        let mut mask = Vec::with_capacity(b * l);
        for row in rows {
            ids.extend_from_slice(row);
            ids.extend(std::iter::repeat_n(c.pad_token_id as u32, l - row.len()));
            mask.extend(std::iter::repeat_n(0f32, row.len()));
            mask.extend(std::iter::repeat_n(f32::NEG_INFINITY, l - row.len()));
        }
        let ids = Tensor::from_vec(ids, b * l, &self.device)?;
        let mask = Tensor::from_vec(mask, (b, 1, 1, l), &self.device)?;
        let max = c.relative_attention_max_distance as i64;
        let buckets: Vec<u32> = (0..l as i64)
            .flat_map(|i| (0..l as i64).map(move |j| (j - i).clamp(-max, max)))
            .map(|r| self.encoder_buckets[(r + max) as usize])
            .collect();
        let buckets = Tensor::from_vec(buckets, l * l, &self.device)?;
        // [l*l, heads] -> [1, heads, l, l]
        let bias = self.encoder_bias.index_select(&buckets, 0)?.reshape((l, l, h))?.permute((2, 0, 1))?.unsqueeze(0)?;
        let bias = bias.broadcast_add(&mask)?;
        let mut x = self.shared.index_select(&ids, 0)?;
        for block in &self.encoder {
            let a = &block.self_attention;
            let hdn = rms_norm(&x, &block.self_norm, c.layer_norm_epsilon)?;
            let heads = |w: &Tensor| -> candle_core::Result<Tensor> { hdn.matmul(&w.t()?)?.reshape((b, l, h, dk))?.transpose(1, 2)?.contiguous() };
            let (q, k, v) = (heads(&a.q)?, heads(&a.k)?, heads(&a.v)?);
            let scores = q.matmul(&k.t()?)?.broadcast_add(&bias)?;
            let weights = candle_nn::ops::softmax_last_dim(&scores)?;
            let context = weights.matmul(&v)?.transpose(1, 2)?.reshape((b * l, h * dk))?;
            x = (x + context.matmul(&a.o.t()?)?)?;
            let hdn = rms_norm(&x, &block.ff_norm, c.layer_norm_epsilon)?;
            x = (&x + block.ff.forward(&hdn)?)?;
        }
        let x = rms_norm(&x, &self.encoder_norm, c.layer_norm_epsilon)?.reshape((b, l, d))?;
        rows.iter().enumerate().map(|(i, r)| x.get(i)?.narrow(0, 0, r.len())).collect()
    }

    /// A decoder state for one encoder output: the cross-attention keys and values of every layer, computed once.
    pub fn start(&self, encoder_output: &Tensor) -> candle_core::Result<DecoderState> {
        let mut cross_keys = Vec::with_capacity(self.decoder.len());
        let mut cross_values = Vec::with_capacity(self.decoder.len());
        for block in &self.decoder {
            let (a, _) = block.cross.as_ref().expect("decoder blocks have cross-attention");
            cross_keys.push(encoder_output.matmul(&a.k.t()?)?.flatten_all()?.to_vec1::<f32>()?);
            cross_values.push(encoder_output.matmul(&a.v.t()?)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let layers = self.decoder.len();
        Ok(DecoderState {
            self_keys: vec![Vec::new(); layers],
            self_values: vec![Vec::new(); layers],
            cross_keys,
            cross_values,
            len: 0,
        })
    }

    /// One decoder step for each sequence: `tokens[i]` is sequence i's next input token. Returns each sequence's
    /// logits for the token after it.
    pub fn decode_step(&self, tokens: &[u32], states: &mut [&mut DecoderState]) -> candle_core::Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let (n, h, dk, inner) = (tokens.len(), c.num_heads, c.d_kv, c.inner());
        if tokens.iter().any(|&t| t as usize >= c.vocab_size) {
            candle_core::bail!("a token id is outside the vocabulary of {}", c.vocab_size);
        }
        let ids = Tensor::from_vec(tokens.to_vec(), n, &self.device)?;
        let mut x = self.shared.index_select(&ids, 0)?;
        for (layer, block) in self.decoder.iter().enumerate() {
            // Self-attention: append this step's key and value, attend over the sequence so far (causal by
            // construction), with the causal relative-position bias.
            let a = &block.self_attention;
            let hdn = rms_norm(&x, &block.self_norm, c.layer_norm_epsilon)?;
            let q = hdn.matmul(&a.q.t()?)?.to_vec2::<f32>()?;
            let k = hdn.matmul(&a.k.t()?)?.to_vec2::<f32>()?;
            let v = hdn.matmul(&a.v.t()?)?.to_vec2::<f32>()?;
            let mut context = vec![0f32; n * inner];
            for (i, state) in states.iter_mut().enumerate() {
                state.self_keys[layer].extend_from_slice(&k[i]);
                state.self_values[layer].extend_from_slice(&v[i]);
                let last = self.decoder_buckets.len() - 1;
                let bias = |head: usize, p: usize| {
                    let bucket = self.decoder_buckets[(state.len - p).min(last)];
                    self.decoder_bias[bucket * h + head]
                };
                attend(&q[i], &state.self_keys[layer], &state.self_values[layer], h, dk, bias, &mut context[i * inner..(i + 1) * inner]);
            }
            let context = Tensor::from_vec(context, (n, inner), &self.device)?;
            x = (x + context.matmul(&a.o.t()?)?)?;
            // Cross-attention over the encoder output, no position bias.
            let (cross, cross_norm) = block.cross.as_ref().expect("decoder blocks have cross-attention");
            let hdn = rms_norm(&x, cross_norm, c.layer_norm_epsilon)?;
            let q = hdn.matmul(&cross.q.t()?)?.to_vec2::<f32>()?;
            let mut context = vec![0f32; n * inner];
            for (i, state) in states.iter().enumerate() {
                let out = &mut context[i * inner..(i + 1) * inner];
                attend(&q[i], &state.cross_keys[layer], &state.cross_values[layer], h, dk, |_, _| 0.0, out);
            }
            let context = Tensor::from_vec(context, (n, inner), &self.device)?;
            x = (x + context.matmul(&cross.o.t()?)?)?;
            let hdn = rms_norm(&x, &block.ff_norm, c.layer_norm_epsilon)?;
            x = (&x + block.ff.forward(&hdn)?)?;
        }
        for state in states.iter_mut() {
            state.len += 1;
        }
        let x = (rms_norm(&x, &self.decoder_norm, c.layer_norm_epsilon)? * self.logit_scale)?;
        x.matmul(&self.lm_head.t()?)?.to_vec2::<f32>()
    }

    /// What the weights were computed as, for the log and the metrics' `weights_layout`.
    pub fn weights_layout(&self) -> &'static str {
        if self.widened { "widened to f32" } else { "as-stored" }
    }

    pub fn weight_bytes(&self) -> usize {
        let t = |t: &Tensor| t.elem_count() * 4;
        let attn = |a: &Attention| t(&a.q) + t(&a.k) + t(&a.v) + t(&a.o);
        let ff = |f: &FeedForward| match f {
            FeedForward::Relu { wi, wo } => t(wi) + t(wo),
            FeedForward::GatedGelu { wi0, wi1, wo } => t(wi0) + t(wi1) + t(wo),
        };
        let blocks = |bs: &[Block]| -> usize { bs.iter().map(|b| attn(&b.self_attention) + b.cross.as_ref().map_or(0, |(a, _)| attn(a)) + ff(&b.ff)).sum() };
        t(&self.shared) + blocks(&self.encoder) + blocks(&self.decoder) + if self.config.tie_word_embeddings { 0 } else { t(&self.lm_head) }
    }
}

/// llama.cpp's T5 files (`general.architecture = "t5"`): the configuration from their keys, the tensors under
/// Hugging Face's names.
mod gguf {
    use std::collections::HashMap;
    use std::fs::File;

    use candle_core::quantized::gguf_file::Content;
    use candle_core::{Device, Tensor};

    use super::T5Config;
    use crate::engine::models::llama::gguf::{meta, meta_f32, meta_u32, meta_usize};
    use crate::engine::ModelError;

    /// llama.cpp computes relative positions up to this distance, a constant there (Hugging Face's default).
    const MAX_DISTANCE: usize = 128;

    pub(super) fn config(content: &Content) -> Result<T5Config, ModelError> {
        let architecture = meta(content, "general.architecture")?.to_string().map_err(|_| ModelError::Metadata("`general.architecture` is not a string".into()))?;
        if *architecture != "t5" {
            return Err(ModelError::Architecture { name: architecture.clone(), supported: "t5 for seq2seq jobs (llama.cpp's t5 architecture, or a Hugging Face directory)" });
        }
        let key = |k: &str| format!("t5.{k}");
        let embedding = content.tensor_infos.get("token_embd.weight").ok_or_else(|| ModelError::Metadata("tensor `token_embd.weight` is missing".into()))?;
        let d_model = meta_usize(content, &key("embedding_length"))?;
        let vocab_size = match embedding.shape.dims() {
            &[v, d] if d == d_model => v,
            dims => return Err(ModelError::Metadata(format!("tensor `token_embd.weight` has shape {dims:?}, expected [vocabulary, {d_model}]"))),
        };
        let num_layers = meta_usize(content, &key("block_count"))?;
        let (d_kv, value) = (meta_usize(content, &key("attention.key_length"))?, meta_usize(content, &key("attention.value_length"))?);
        if d_kv != value {
            return Err(ModelError::Metadata(format!("keys of {d_kv} values and values of {value}: T5's are the same size")));
        }
        // UMT5 has a relative-position bias in every layer; T5 has it in the first, shared by the others.
        if let Some(name) = ["enc", "dec"].iter().map(|s| format!("{s}.blk.1.attn_rel_b.weight")).find(|n| content.tensor_infos.contains_key(n)) {
            return Err(ModelError::Metadata(format!("tensor `{name}`: a relative-position bias per layer (UMT5) is not supported; T5 shares the first layer's")));
        }
        let eps = meta_f32(content, &key("attention.layer_norm_rms_epsilon")).or_else(|| meta_f32(content, &key("attention.layer_norm_epsilon")));
        let gated = content.tensor_infos.contains_key("enc.blk.0.ffn_gate.weight");
        Ok(T5Config {
            vocab_size,
            d_model,
            d_kv,
            d_ff: meta_usize(content, &key("feed_forward_length"))?,
            num_layers,
            num_decoder_layers: Some(meta_u32(content, &key("decoder_block_count")).map_or(num_layers, |n| n as usize)),
            num_heads: meta_usize(content, &key("attention.head_count"))?,
            relative_attention_num_buckets: meta_usize(content, &key("attention.relative_buckets_count"))?,
            relative_attention_max_distance: MAX_DISTANCE,
            layer_norm_epsilon: eps.map_or(1e-6, f64::from),
            feed_forward_proj: if gated { "gated-gelu" } else { "relu" }.into(),
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
            pad_token_id: meta_u32(content, "tokenizer.ggml.padding_token_id").unwrap_or(0) as usize,
            eos_token_id: meta_u32(content, "tokenizer.ggml.eos_token_id").unwrap_or(1) as usize,
            decoder_start_token_id: meta_u32(content, &key("decoder_start_token_id")).map(|id| id as usize),
            model_type: Some("t5".into()),
        })
        .and_then(|c| super::check(&c).map(|_| c))
    }

    /// Hugging Face's name of a tensor of llama.cpp's T5 (its converter's map, read backwards), or `None` for one
    /// the model does not use (the cross-attention's relative bias, which llama.cpp loads and never reads).
    fn hf_name(name: &str, gated: bool) -> Result<Option<String>, ModelError> {
        let fixed = match name {
            "token_embd.weight" => Some("shared.weight"),
            "output.weight" => Some("lm_head.weight"),
            "enc.output_norm.weight" => Some("encoder.final_layer_norm.weight"),
            "dec.output_norm.weight" => Some("decoder.final_layer_norm.weight"),
            _ => None,
        };
        if let Some(hf) = fixed {
            return Ok(Some(hf.into()));
        }
        let unknown = || ModelError::Metadata(format!("tensor `{name}` is not one of T5's"));
        let (stack, rest) = match name.split_once(".blk.") {
            Some(("enc", rest)) => ("encoder", rest),
            Some(("dec", rest)) => ("decoder", rest),
            _ => return Err(unknown()),
        };
        let (layer, part) = rest.split_once('.').ok_or_else(unknown)?;
        let layer: usize = layer.parse().map_err(|_| unknown())?;
        let ffn = if stack == "decoder" { 2 } else { 1 };
        let p = format!("{stack}.block.{layer}.layer");
        let hf = match part {
            "attn_norm.weight" => format!("{p}.0.layer_norm.weight"),
            "attn_q.weight" | "attn_k.weight" | "attn_v.weight" | "attn_o.weight" => format!("{p}.0.SelfAttention.{}.weight", &part[5..6]),
            "attn_rel_b.weight" => format!("{p}.0.SelfAttention.relative_attention_bias.weight"),
            "cross_attn_norm.weight" if stack == "decoder" => format!("{p}.1.layer_norm.weight"),
            "cross_attn_q.weight" | "cross_attn_k.weight" | "cross_attn_v.weight" | "cross_attn_o.weight" if stack == "decoder" => {
                format!("{p}.1.EncDecAttention.{}.weight", &part[11..12])
            }
            "cross_attn_rel_b.weight" if stack == "decoder" => return Ok(None),
            "ffn_norm.weight" => format!("{p}.{ffn}.layer_norm.weight"),
            "ffn_gate.weight" if gated => format!("{p}.{ffn}.DenseReluDense.wi_0.weight"),
            "ffn_up.weight" => format!("{p}.{ffn}.DenseReluDense.{}.weight", if gated { "wi_1" } else { "wi" }),
            "ffn_down.weight" => format!("{p}.{ffn}.DenseReluDense.wo.weight"),
            _ => return Err(unknown()),
        };
        Ok(Some(hf))
    }

    /// Every tensor of the file, dequantized to f32, under Hugging Face's name. The outer error is the file's
    /// (a read that fails), the inner the model's (a tensor T5 does not have).
    pub(super) fn tensors(file: &mut File, content: &Content, config: &T5Config, device: &Device) -> candle_core::Result<Result<HashMap<String, Tensor>, ModelError>> {
        let gated = config.feed_forward_proj == "gated-gelu";
        let mut out = HashMap::with_capacity(content.tensor_infos.len());
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        for name in names {
            let hf = match hf_name(name, gated) {
                Ok(Some(hf)) => hf,
                Ok(None) => continue,
                Err(e) => return Ok(Err(e)),
            };
            let tensor = content.tensor(file, name, device)?.dequantize(device)?;
            out.insert(hf, tensor);
        }
        Ok(Ok(out))
    }

    #[cfg(test)]
    mod tests {
        use super::hf_name;

        #[test]
        fn llama_cpp_names_map_to_hugging_face_names() {
            let hf = |n: &str, gated| hf_name(n, gated).unwrap().unwrap();
            assert_eq!(hf("enc.blk.3.attn_o.weight", false), "encoder.block.3.layer.0.SelfAttention.o.weight");
            assert_eq!(hf("dec.blk.0.cross_attn_k.weight", false), "decoder.block.0.layer.1.EncDecAttention.k.weight");
            assert_eq!(hf("dec.blk.2.ffn_norm.weight", true), "decoder.block.2.layer.2.layer_norm.weight");
            assert_eq!(hf("enc.blk.1.ffn_norm.weight", true), "encoder.block.1.layer.1.layer_norm.weight");
            assert_eq!(hf("enc.blk.1.ffn_up.weight", true), "encoder.block.1.layer.1.DenseReluDense.wi_1.weight");
            assert_eq!(hf("enc.blk.1.ffn_up.weight", false), "encoder.block.1.layer.1.DenseReluDense.wi.weight");
            assert_eq!(hf("dec.blk.1.ffn_gate.weight", true), "decoder.block.1.layer.2.DenseReluDense.wi_0.weight");
            assert_eq!(hf_name("dec.blk.0.cross_attn_rel_b.weight", false).unwrap(), None);
            for bad in ["enc.blk.0.cross_attn_q.weight", "enc.blk.x.attn_q.weight", "blk.0.attn_q.weight", "dec.blk.0.ffn_gate.weight"] {
                assert!(hf_name(bad, false).is_err(), "{bad}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::relative_bucket;

    #[test]
    fn buckets_saturate_at_the_max_distance_so_tables_can_clamp() {
        for bidirectional in [true, false] {
            let last = relative_bucket(-128, bidirectional, 32, 128);
            for far in [129, 500, 100_000] {
                assert_eq!(relative_bucket(-far, bidirectional, 32, 128), last);
            }
        }
        assert_eq!(relative_bucket(128, true, 32, 128), relative_bucket(100_000, true, 32, 128));
    }

    #[test]
    fn buckets_follow_the_reference_rule() {
        // Bidirectional, 32 buckets: 16 per direction, 8 exact distances each.
        assert_eq!(relative_bucket(0, true, 32, 128), 0);
        assert_eq!(relative_bucket(-3, true, 32, 128), 3);
        assert_eq!(relative_bucket(3, true, 32, 128), 19);
        assert_eq!(relative_bucket(-7, true, 32, 128), 7);
        assert!(relative_bucket(-8, true, 32, 128) >= 8 && relative_bucket(-8, true, 32, 128) < 16);
        assert_eq!(relative_bucket(-1000, true, 32, 128), 15);
        assert_eq!(relative_bucket(1000, true, 32, 128), 31);
        // Causal (decoder): keys after the query all land in bucket 0; 16 exact distances back.
        assert_eq!(relative_bucket(5, false, 32, 128), 0);
        assert_eq!(relative_bucket(-15, false, 32, 128), 15);
        assert!(relative_bucket(-16, false, 32, 128) >= 16);
        assert_eq!(relative_bucket(-1000, false, 32, 128), 31);
    }
}
