//! The llama-family decoder, with per-token positions and a KV cache held outside the model. Weights come from a
//! GGUF file or a Hugging Face directory ([`hf`]); [`inspect`] and [`Model::load`] tell them apart by whether the
//! path is a directory.
//!
//! One forward pass takes a list of [`Segment`]s: each is a run of new tokens of one sequence, starting at that
//! sequence's current length. A prefill is a segment of a whole prompt; a decode step is a segment of one token;
//! several of both are packed into one pass, so every weight matrix is read once per step for all of them.
//! Matrix products run on candle's quantized kernels, with the weights laid out for them at load ([`Layout`]);
//! attention runs over the blocked [`KvCache`] of each sequence in plain Rust, parallel over (segment, kv head,
//! tile of new tokens), so sequences of different lengths never need padding or masks.

use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use rayon::prelude::*;

use super::ModelError;
use crate::tokenize::VocabMetadata;

// A child of this module, so that it builds `Model` and `Layer` from their private fields; the file sits beside
// this one.
#[path = "hf.rs"]
pub mod hf;
// The device-resident forward pass and its paged KV cache, for accelerators; a child for the same reason.
#[path = "paged.rs"]
mod paged;
pub use paged::StepLogits;

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
    /// Llama 3's rescaling of the RoPE frequencies, when the checkpoint declares it.
    pub rope_scaling: Option<RopeScaling>,
    pub vocab_size: usize,
}

/// Llama 3's RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`): wavelengths longer than
/// `original_context / low_freq_factor` are stretched by `factor`, shorter than `original_context /
/// high_freq_factor` kept, and those between interpolated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_context: usize,
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
    /// Biases of the q, k and v projections (Qwen2; llama checkpoints with `attention_bias`), `[rows]` each.
    qkv_bias: Option<[Tensor; 3]>,
    /// Bias of the output projection (llama and Qwen3 checkpoints with `attention_bias`).
    wo_bias: Option<Tensor>,
    /// Per-head RMSNorm weights of queries and keys, `[head_dim]` each, applied before RoPE (Qwen3).
    qk_norm: Option<[Tensor; 2]>,
    ffn_norm: Tensor,
    w_gate: QMatMul,
    w_up: QMatMul,
    w_down: QMatMul,
}

impl Layer {
    /// Queries, keys and values of the normed hidden states `h`, `[tokens][heads x head_dim]` each, before RoPE.
    fn qkv(&self, h: &Tensor, head_dim: usize, eps: f32) -> candle_core::Result<[Tensor; 3]> {
        let [q, k, v] = matmuls(h, [&self.wq, &self.wk, &self.wv])?;
        let [q, k, v] = match &self.qkv_bias {
            Some([bq, bk, bv]) => [q.broadcast_add(bq)?, k.broadcast_add(bk)?, v.broadcast_add(bv)?],
            None => [q, k, v],
        };
        let Some([q_norm, k_norm]) = &self.qk_norm else { return Ok([q, k, v]) };
        let per_head = |x: Tensor, w: &Tensor| -> candle_core::Result<Tensor> {
            let (n, width) = x.dims2()?;
            candle_nn::ops::rms_norm(&x.reshape((n * width / head_dim, head_dim))?, w, eps)?.reshape((n, width))
        };
        Ok([per_head(q, q_norm)?, per_head(k, k_norm)?, v])
    }

    fn output(&self, attn: &Tensor) -> candle_core::Result<Tensor> {
        let out = product(&self.wo, attn)?;
        match &self.wo_bias {
            Some(b) => out.broadcast_add(b),
            None => Ok(out),
        }
    }
}

pub struct Model {
    pub config: ModelConfig,
    device: Device,
    /// The paged path's device state, when the model runs on it (every accelerator; the CPU when asked).
    paged: Option<paged::Paged>,
    /// Widths as laid out in memory: the hidden state and the attention output, each zero-padded to a multiple of
    /// 256 on CPU (see [`Layout`]); equal to the model's widths otherwise.
    width: usize,
    attn_width: usize,
    embedding: Tensor,
    layers: Vec<Layer>,
    output_norm: Tensor,
    lm_head: QMatMul,
    /// cos and sin of position x frequency, `[context_length][head_dim / 2]` each.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
}

/// The weights of a [`Model`], as a loader hands them over.
struct Weights {
    embedding: Tensor,
    layers: Vec<Layer>,
    output_norm: Tensor,
    lm_head: QMatMul,
    /// The attention output's width in memory (the input width of each layer's `wo`).
    attn_width: usize,
}

/// The rotary frequency of each pair of a head's values, `base^(-2i / head_dim)`, with Llama 3's rescaling when
/// the model declares it (as Hugging Face's `_compute_llama3_parameters`).
fn rope_frequencies(config: &ModelConfig) -> Vec<f64> {
    let hd = config.head_dim;
    (0..hd / 2)
        .map(|i| {
            let freq = 1.0 / (config.rope_base as f64).powf(2.0 * i as f64 / hd as f64);
            let Some(s) = config.rope_scaling else { return freq };
            let wavelength = 2.0 * std::f64::consts::PI / freq;
            let original = s.original_context as f64;
            if wavelength < original / s.high_freq_factor {
                freq
            } else if wavelength > original / s.low_freq_factor {
                freq / s.factor
            } else {
                let smooth = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * freq / s.factor + smooth * freq
            }
        })
        .collect()
}

/// Positions per block of the KV cache: the width of the score vectors in attention.
const BLOCK: usize = 16;

/// Positions per KV cache block, for the scheduler's accounting.
pub const KV_BLOCK_TOKENS: usize = BLOCK;

/// The keys and values of one sequence, all layers: its length, and where they are held ([`Store`]).
/// [`Model::new_cache`] makes the right kind for a model and [`Model::fork_cache`] copies one; a cache of one path
/// is refused by the other.
#[derive(Debug)]
pub struct KvCache {
    store: Store,
    len: usize,
}

#[derive(Debug)]
enum Store {
    Host(HostBlocks),
    /// On the paged path ([`paged`]) the blocks live in the model's device pool, and the cache holds their ids.
    Paged(paged::Blocks),
}

/// The CPU path's cache: in blocks of [`BLOCK`] positions, each block its own allocation. Per layer and block,
/// keys are `[kv_head][head_dim][BLOCK]` (transposed, so one query's scores against a block are `head_dim`
/// multiply-adds of `BLOCK`-wide vectors, with no horizontal sums) and values are `[kv_head][BLOCK][head_dim]`; a
/// block's unused positions are zero. A sequence grows a block at a time without copying what it holds, and
/// holds exactly the blocks the scheduler booked for it.
#[derive(Clone, Debug)]
struct HostBlocks {
    keys: Vec<Vec<Box<[f32]>>>,
    values: Vec<Vec<Box<[f32]>>>,
    kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    /// An empty CPU-path cache with room in its block tables for `capacity_tokens` (blocks are allocated as they
    /// fill).
    pub fn new(config: &ModelConfig, capacity_tokens: usize) -> KvCache {
        let alloc = || (0..config.layers).map(|_| Vec::with_capacity(capacity_tokens.div_ceil(BLOCK))).collect();
        let host = HostBlocks { keys: alloc(), values: alloc(), kv_heads: config.kv_heads, head_dim: config.head_dim };
        KvCache { store: Store::Host(host), len: 0 }
    }

    /// Positions held (the sequence's length so far).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks held (per layer; the same in every layer).
    pub fn blocks(&self) -> usize {
        match &self.store {
            Store::Host(host) => host.keys.first().map_or(0, Vec::len),
            Store::Paged(blocks) => blocks.len(),
        }
    }

    /// The CPU path's blocks; the forward pass checks every segment's store before it begins.
    fn host(&self) -> &HostBlocks {
        match &self.store {
            Store::Host(host) => host,
            Store::Paged(_) => unreachable!("checked at the start of the forward pass"),
        }
    }

    fn host_mut(&mut self) -> &mut HostBlocks {
        match &mut self.store {
            Store::Host(host) => host,
            Store::Paged(_) => unreachable!("checked at the start of the forward pass"),
        }
    }

    fn paged(&self) -> Option<&paged::Blocks> {
        match &self.store {
            Store::Paged(blocks) => Some(blocks),
            Store::Host(_) => None,
        }
    }

    fn paged_mut(&mut self) -> Option<&mut paged::Blocks> {
        match &mut self.store {
            Store::Paged(blocks) => Some(blocks),
            Store::Host(_) => None,
        }
    }
}

impl HostBlocks {
    fn block_floats(&self) -> usize {
        self.kv_heads * self.head_dim * BLOCK
    }

    /// Stores the keys and values of positions `start..` of one layer, `[token][kv_head][head_dim]` each.
    fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let (hd, row, bf) = (self.head_dim, self.kv_heads * self.head_dim, self.block_floats());
        let tokens = k.len() / row;
        let needed = (start + tokens).div_ceil(BLOCK);
        let (keys, values) = (&mut self.keys[layer], &mut self.values[layer]);
        while keys.len() < needed {
            keys.push(vec![0f32; bf].into_boxed_slice());
            values.push(vec![0f32; bf].into_boxed_slice());
        }
        for t in 0..tokens {
            let (b, c) = ((start + t) / BLOCK, (start + t) % BLOCK);
            let (kb, vb) = (&mut keys[b], &mut values[b]);
            for h in 0..self.kv_heads {
                let src = t * row + h * hd;
                for d in 0..hd {
                    kb[(h * hd + d) * BLOCK + c] = k[src + d];
                }
                vb[(h * BLOCK + c) * hd..][..hd].copy_from_slice(&v[src..src + hd]);
            }
        }
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
        return Err(ModelError::Architecture { name: architecture, supported: "llama in GGUF files" });
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
        rope_scaling: None,
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
        more_ends: Vec::new(),
        add_bos: content.metadata.get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(false),
        chat_template: content.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok().cloned()),
        tokens,
        token_types,
        tokenizer: None,
    };
    let mut counts = std::collections::BTreeMap::new();
    for info in content.tensor_infos.values() {
        *counts.entry(format!("{:?}", info.ggml_dtype).to_lowercase()).or_insert(0) += 1;
    }
    Ok(ModelInfo { config, vocab, tensor_types: counts.into_iter().collect() })
}

/// How weights are laid out for the matmul kernels of this device.
///
/// On CPU, candle's fast kernels (repacked tiles on AVX-512 VNNI) take Q8_0, Q6_K and Q4_K weights whose inner
/// dimension K is a multiple of 256 and whose row count is a multiple of 16; anything else falls back to generic
/// dot products at a fifth of the speed or less (Q4_1, the GGUF's own type, is scalar). SmolLM2's hidden size is
/// 576. So the model is laid out padded: the hidden state, the attention output and the feed-forward state are
/// zero-padded to a multiple of 256 from the embedding on, every matrix gets zero columns (and zero rows where
/// its output feeds the hidden state), and the weights are requantized. Padded columns stay exactly zero through
/// the residual stream: zero rows produce zeros, SiLU(0) x 0 is 0, and the RMSNorm weights' padding is zero. The
/// norms divide by the padded width, which the weights and epsilon are rescaled for (`padded_norm`), so the
/// model computes the same function; the price is a third more multiply-adds at K = 576 for kernels several times
/// faster (`../shared/reference/cpu-matmul.md`).
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
}

impl Layout {
    /// The layout for a model on a device: on CPU, layers in padded Q4_K and the output projection in padded
    /// Q6_K (Q4_K would add 8.7 % error to it; candle's Q8_0 has no fast kernel here), unless padding would add more
    /// than a third to a width (then [`Layout::Q8`]); as stored elsewhere.
    /// `NIGHTSHIFT_CPU_WEIGHTS=q4k|q6k|q8_0|q8|as-stored` chooses another, for benchmarks and comparisons.
    pub fn choose(device: &Device, config: &ModelConfig) -> Layout {
        use candle_core::quantized::GgmlDType;
        if !device.is_cpu() {
            return Layout::AsStored;
        }
        match std::env::var("NIGHTSHIFT_CPU_WEIGHTS").as_deref() {
            Ok("as-stored") => return Layout::AsStored,
            Ok("q8") => return Layout::Q8,
            Ok("q6k") => return Layout::Padded(GgmlDType::Q6K, GgmlDType::Q6K),
            Ok("q8_0") => return Layout::Padded(GgmlDType::Q8_0, GgmlDType::Q8_0),
            Ok("q4k") => return Layout::Padded(GgmlDType::Q4K, GgmlDType::Q6K),
            _ => {}
        }
        let padded = Layout::Padded(GgmlDType::Q4K, GgmlDType::Q6K);
        let worth = |w: usize| padded.pad(w) * 3 <= w * 4;
        if worth(config.hidden_size) && worth(config.heads * config.head_dim) && worth(config.ffn_size) {
            padded
        } else {
            Layout::Q8
        }
    }

    fn pad(self, width: usize) -> usize {
        match self {
            Layout::AsStored | Layout::Q8 => width,
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

/// A weight matrix `[n, k]` laid out as `[n_pad, k_pad]`, zero-filled, requantized.
fn lay_out(t: QTensor, n_pad: usize, k_pad: usize, layout: Layout, device: &Device) -> candle_core::Result<QTensor> {
    use candle_core::quantized::GgmlDType;
    let dtype = match layout {
        Layout::AsStored => return Ok(t),
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

/// Reads a model's metadata (architecture, shapes, tokenizer) without loading its weights: a GGUF file, or a
/// Hugging Face directory (whose tensors' names and shapes are checked too).
pub fn inspect(path: &Path) -> Result<ModelInfo, ModelError> {
    if path.is_dir() {
        return hf::inspect(path);
    }
    let (_, content) = read_content(path)?;
    info_of(&content)
}

impl Model {
    /// Loads a llama-family model onto `device`: a GGUF file laid out for its kernels, or a Hugging Face
    /// directory ([`hf`]).
    pub fn load(path: &Path, device: &Device) -> Result<(Model, ModelInfo), ModelError> {
        Model::load_with(path, device, None)
    }

    /// Loads a Hugging Face directory with its weights and activations in `dtype` (anything but f32 runs the
    /// paged path, the only one that computes in other dtypes).
    pub fn load_hf_as(dir: &Path, device: &Device, dtype: DType) -> Result<(Model, ModelInfo), ModelError> {
        hf::load(dir, device, Some(dtype))
    }

    /// Loads a GGUF llama-family model with the given weight layout (`None`: [`Layout::choose`]'s). A Hugging Face
    /// directory has one layout, dense f32 weights, and ignores `layout`.
    pub fn load_with(path: &Path, device: &Device, layout: Option<Layout>) -> Result<(Model, ModelInfo), ModelError> {
        if path.is_dir() {
            return hf::load(path, device, None);
        }
        let (mut file, content) = read_content(path)?;
        let info = info_of(&content)?;
        let layout = layout.unwrap_or_else(|| Layout::choose(device, &info.config));
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
        let (width, attn_width, ffn_width) = (layout.pad(d), layout.pad(config.heads * hd), layout.pad(config.ffn_size));
        let embedding_q = qtensor("token_embd.weight")?;
        expect(&embedding_q, "token_embd.weight", &[config.vocab_size, d])?;
        let embedding = embedding_q.dequantize(device).and_then(|e| e.pad_with_zeros(1, 0, width - d)).map_err(fmt)?;
        // Every layer's matrices are read first, then laid out (requantized) in parallel: it is most of load time.
        let (q, kv, f) = (config.heads * hd, config.kv_heads * hd, config.ffn_size);
        // (name, shape in the file, laid-out [rows, columns]), in the order `Layer` takes them.
        let shapes: [(&str, [usize; 2], [usize; 2]); 7] = [
            ("attn_q", [q, d], [q, width]),
            ("attn_k", [kv, d], [kv, width]),
            ("attn_v", [kv, d], [kv, width]),
            ("attn_output", [d, q], [width, attn_width]),
            ("ffn_gate", [f, d], [ffn_width, width]),
            ("ffn_up", [f, d], [ffn_width, width]),
            ("ffn_down", [d, f], [width, ffn_width]),
        ];
        let mut raw = Vec::with_capacity(config.layers * shapes.len());
        for i in 0..config.layers {
            for (suffix, dims, pad) in shapes {
                let name = format!("blk.{i}.{suffix}.weight");
                let t = qtensor(&name)?;
                expect(&t, &name, &dims)?;
                raw.push((t, pad));
            }
        }
        let laid_out: Vec<QMatMul> = raw
            .into_par_iter()
            .map(|(t, pad)| lay_out(t, pad[0], pad[1], layout, device).and_then(QMatMul::from_qtensor))
            .collect::<candle_core::Result<_>>()
            .map_err(fmt)?;
        let mut matrices = laid_out.into_iter();
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let mut next = || matrices.next().expect("seven matrices per layer");
            let (wq, wk, wv, wo, w_gate, w_up, w_down) = (next(), next(), next(), next(), next(), next(), next());
            let mut norm = |suffix: &str| -> Result<Tensor, ModelError> {
                let name = format!("blk.{i}.{suffix}.weight");
                let t = qtensor(&name)?;
                expect(&t, &name, &[d])?;
                t.dequantize(device).and_then(|w| padded_norm(w, width)).map_err(fmt)
            };
            let attn_norm = norm("attn_norm")?;
            let ffn_norm = norm("ffn_norm")?;
            layers.push(Layer { attn_norm, wq, wk, wv, wo, qkv_bias: None, wo_bias: None, qk_norm: None, ffn_norm, w_gate, w_up, w_down });
        }
        let output_norm = qtensor("output_norm.weight")?;
        expect(&output_norm, "output_norm.weight", &[d])?;
        let output_norm = output_norm.dequantize(device).and_then(|w| padded_norm(w, width)).map_err(fmt)?;
        // Tied embeddings: without `output.weight`, the embedding matrix is the output projection.
        let lm_head = match content.tensor_infos.contains_key("output.weight") {
            true => {
                let t = qtensor("output.weight")?;
                expect(&t, "output.weight", &[config.vocab_size, d])?;
                t
            }
            false => embedding_q,
        };
        let lm_head = QMatMul::from_qtensor(lay_out(lm_head, config.vocab_size, width, layout.for_output(), device).map_err(fmt)?).map_err(fmt)?;

        let weights = Weights { embedding, layers, output_norm, lm_head, attn_width };
        Ok((Model::assemble(config, device, weights)?, info))
    }

    /// A model from its weights, with the RoPE tables of its configuration. `weights.embedding`'s width is the
    /// hidden state's width in memory. Off the CPU it runs the paged path, its KV cache in the activations' dtype.
    fn assemble(config: ModelConfig, device: &Device, weights: Weights) -> Result<Model, ModelError> {
        let Weights { embedding, layers, output_norm, lm_head, attn_width } = weights;
        let frequencies = rope_frequencies(&config);
        let mut rope_cos = Vec::with_capacity(config.context_length * frequencies.len());
        let mut rope_sin = Vec::with_capacity(config.context_length * frequencies.len());
        for pos in 0..config.context_length {
            for freq in &frequencies {
                let angle = pos as f64 * freq;
                rope_cos.push(angle.cos() as f32);
                rope_sin.push(angle.sin() as f32);
            }
        }
        let mut model = Model {
            width: embedding.dims().last().copied().unwrap_or(config.hidden_size),
            config,
            device: device.clone(),
            paged: None,
            attn_width,
            embedding,
            layers,
            output_norm,
            lm_head,
            rope_cos,
            rope_sin,
        };
        // `NIGHTSHIFT_PAGED=1` runs the paged path on the CPU too: for checking it end to end against the CPU path.
        let asked = std::env::var_os("NIGHTSHIFT_PAGED").is_some_and(|v| v == "1");
        if !device.is_cpu() || model.dtype() != DType::F32 || asked {
            model.use_paged().map_err(|e| ModelError::Metadata(format!("cannot set up the device KV cache: {e}")))?;
        }
        Ok(model)
    }

    /// Switches the model to the paged path ([`paged`]): the KV cache in a device pool and attention in tensor
    /// ops. Every accelerator runs it; on the CPU it is for checking it against the CPU path. Caches made before
    /// belong to the other path and are refused by [`Model::forward`].
    pub fn use_paged(&mut self) -> candle_core::Result<()> {
        let dtype = self.embedding.dtype();
        self.paged = Some(paged::Paged::new(&self.config, &self.rope_cos, &self.rope_sin, dtype, &self.device)?);
        // Only the CPU path reads the host RoPE tables.
        (self.rope_cos, self.rope_sin) = (Vec::new(), Vec::new());
        Ok(())
    }

    /// Whether the model runs the paged path.
    pub fn is_paged(&self) -> bool {
        self.paged.is_some()
    }

    /// The activations' dtype (and the paged KV cache's).
    pub fn dtype(&self) -> DType {
        self.embedding.dtype()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Makes the model's CUDA context current on the calling thread: the engine thread calls it before its first
    /// step, the weights having been uploaded from the thread that loaded them. (cudarc binds the context on most
    /// calls too; this makes the engine thread's ownership explicit.) A no-op on the CPU.
    pub fn bind_to_thread(&self) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = &self.device {
            cuda.cuda_stream().context().bind_to_thread().map_err(|e| candle_core::Error::Msg(format!("cannot bind the CUDA context: {e}")))?;
        }
        Ok(())
    }

    /// Sizes the paged path's KV pool, in blocks of [`KV_BLOCK_TOKENS`]: the scheduler's budget, which it never
    /// books beyond. It is allocated on the device at the first forward pass. A no-op on the CPU path, whose
    /// blocks are allocated as they fill.
    pub fn set_kv_blocks(&self, blocks: usize) -> candle_core::Result<()> {
        match &self.paged {
            Some(p) => p.set_blocks(blocks),
            None => Ok(()),
        }
    }

    /// An empty KV cache for this model's path, with room in its block tables for `capacity_tokens`.
    pub fn new_cache(&self, capacity_tokens: usize) -> KvCache {
        match &self.paged {
            Some(p) => KvCache { store: Store::Paged(p.empty()), len: 0 },
            None => KvCache::new(&self.config, capacity_tokens),
        }
    }

    /// A copy of a sequence's cache, for a fork (`n` choices): on the paged path, new pool blocks with the same
    /// rows, which can fail (the pool is full, a device error).
    pub fn fork_cache(&self, cache: &KvCache) -> candle_core::Result<KvCache> {
        let store = match (&self.paged, &cache.store) {
            (Some(p), Store::Paged(blocks)) => Store::Paged(p.fork(blocks)?),
            (None, Store::Host(host)) => Store::Host(host.clone()),
            _ => candle_core::bail!("a KV cache of the other path"),
        };
        Ok(KvCache { store, len: cache.len })
    }

    /// KV cache bytes of one block of [`KV_BLOCK_TOKENS`] positions on this model's path: f32 on the CPU path,
    /// the activations' dtype on the paged path (2 bytes for bf16).
    pub fn kv_block_bytes(&self) -> usize {
        let element = if self.is_paged() { self.dtype().size_in_bytes() } else { std::mem::size_of::<f32>() };
        let c = &self.config;
        c.layers * 2 * c.kv_heads * c.head_dim * element * BLOCK
    }

    /// Bytes of weights held on the device (quantized sizes as stored; a tied output projection once).
    pub fn weight_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let q = |m: &QMatMul| match m {
            QMatMul::QTensor(t) => t.storage_size_in_bytes(),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => dense(t),
        };
        let lm_head = match &self.lm_head {
            QMatMul::Tensor(t) if t.id() == self.embedding.id() => 0,
            other => q(other),
        };
        let extras = |l: &Layer| {
            l.qkv_bias.iter().flatten().chain(&l.wo_bias).chain(l.qk_norm.iter().flatten()).map(dense).sum::<usize>()
        };
        dense(&self.embedding)
            + dense(&self.output_norm)
            + lm_head
            + self
                .layers
                .iter()
                .map(|l| {
                    dense(&l.attn_norm)
                        + dense(&l.ffn_norm)
                        + extras(l)
                        + [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].into_iter().map(q).sum::<usize>()
                })
                .sum::<usize>()
    }

    /// Runs the new tokens of every segment through the model, appending their keys and values to each segment's
    /// cache, and returns the logits after the last token of each segment, `[segments][vocab]`.
    pub fn forward(&self, segments: &mut [Segment<'_>]) -> candle_core::Result<Vec<Vec<f32>>> {
        let outputs = vec![1; segments.len()];
        Ok(self.forward_outputs(segments, &outputs)?.into_iter().map(|mut rows| rows.remove(0)).collect())
    }

    /// As [`Model::forward`], with the logits of the last `outputs[i]` positions of segment `i` (in position
    /// order): prompt scoring needs the next-token distribution after every token of a completion.
    pub fn forward_outputs(&self, segments: &mut [Segment<'_>], outputs: &[usize]) -> candle_core::Result<Vec<Vec<Vec<f32>>>> {
        let rows = self.forward_step(segments, outputs, &[])?;
        Ok(rows
            .into_iter()
            .map(|rows| {
                rows.into_iter()
                    .map(|r| match r {
                        StepLogits::Full(l) => l,
                        StepLogits::Argmax(_) => unreachable!("no greedy rows were asked for"),
                    })
                    .collect()
            })
            .collect())
    }

    /// As [`Model::forward_outputs`], for the engine: `greedy[i]` (where given) says segment `i` (with one
    /// output) needs only its argmax. The paged path then computes it on the device and reads back one token
    /// ([`StepLogits::Argmax`]); the CPU path returns logits for every row, its argmax being a pass over them.
    pub fn forward_step(&self, segments: &mut [Segment<'_>], outputs: &[usize], greedy: &[bool]) -> candle_core::Result<Vec<Vec<StepLogits>>> {
        if let Some(p) = &self.paged {
            return self.forward_paged(p, segments, outputs, greedy);
        }
        if segments.iter().any(|s| s.cache.paged().is_some()) {
            candle_core::bail!("a paged KV cache in a CPU-path forward pass");
        }
        let (positions, tokens) = self.check_segments(segments, outputs)?;
        let cfg = &self.config;
        let n = tokens.len();
        let ids = Tensor::from_vec(tokens, n, &self.device)?;
        let mut x = self.embedding.index_select(&ids, 0)?;
        let (hd, kv_row) = (cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        // RMSNorm over the padded width, with epsilon scaled as the weights were (see `padded_norm`).
        let eps = cfg.rms_eps * (cfg.hidden_size as f32 / self.width as f32);
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let [q, k, v] = layer.qkv(&h, hd, cfg.rms_eps)?;
            let mut q = q.flatten_all()?.to_vec1::<f32>()?;
            let mut k = k.flatten_all()?.to_vec1::<f32>()?;
            let v = v.flatten_all()?.to_vec1::<f32>()?;
            for (t, &pos) in positions.iter().enumerate() {
                self.rope(&mut q[t * cfg.heads * hd..(t + 1) * cfg.heads * hd], pos);
                self.rope(&mut k[t * kv_row..(t + 1) * kv_row], pos);
            }
            let mut offset = 0;
            for s in segments.iter_mut() {
                let (len, start) = (s.tokens.len(), s.cache.len);
                s.cache.host_mut().write(li, start, &k[offset * kv_row..(offset + len) * kv_row], &v[offset * kv_row..(offset + len) * kv_row]);
                offset += len;
            }
            let attn = self.attention(li, &q, segments);
            let attn = Tensor::from_vec(attn, (n, self.attn_width), &self.device)?;
            x = (x + layer.output(&attn)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let [gate, up] = matmuls(&h, [&layer.w_gate, &layer.w_up])?;
            let ff = product(&layer.w_down, &(candle_nn::ops::silu(&gate)? * up)?)?;
            x = (x + ff)?;
        }
        for s in segments.iter_mut() {
            s.cache.len += s.tokens.len();
        }
        let logits = self.head(&x, segments, outputs)?;
        let rows = logits.dim(0)?;
        let mut logits = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?.into_iter();
        debug_assert_eq!(rows, outputs.iter().sum::<usize>());
        Ok(outputs.iter().map(|&o| logits.by_ref().take(o).map(StepLogits::Full).collect()).collect())
    }

    /// Checks a step's segments (outputs, context, vocabulary); returns every new token's position and id, in
    /// order.
    fn check_segments(&self, segments: &[Segment<'_>], outputs: &[usize]) -> candle_core::Result<(Vec<usize>, Vec<u32>)> {
        let cfg = &self.config;
        if outputs.len() != segments.len() || segments.iter().zip(outputs).any(|(s, &o)| o == 0 || o > s.tokens.len()) {
            candle_core::bail!("each segment needs between 1 and its token count of outputs");
        }
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
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            candle_core::bail!("token id {bad} is outside the vocabulary");
        }
        Ok((positions, tokens))
    }

    /// Logits of the last `outputs[i]` positions of each segment, `[rows, vocab]` in the activations' dtype,
    /// from the final hidden states `x` of all the step's tokens.
    fn head(&self, x: &Tensor, segments: &[Segment<'_>], outputs: &[usize]) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let eps = cfg.rms_eps * (cfg.hidden_size as f32 / self.width as f32);
        let mut last = Vec::with_capacity(outputs.iter().sum());
        let mut end = 0u32;
        for (s, &o) in segments.iter().zip(outputs) {
            end += s.tokens.len() as u32;
            last.extend(end - o as u32..end);
        }
        let count = last.len();
        let last = Tensor::from_vec(last, count, &self.device)?;
        let x = x.index_select(&last, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.output_norm, eps)?;
        // candle's Q6_K takes its fast kernel only for two rows or more, and the two kernels round differently:
        // a lone row gets a zero row beside it, so a sequence's logits never depend on how many share its step.
        let rows = x.dim(0)?;
        if rows == 1 && self.device.is_cpu() {
            return product(&self.lm_head, &Tensor::cat(&[&x, &x.zeros_like()?], 0)?)?.narrow(0, 0, 1);
        }
        product(&self.lm_head, &x)
    }

    /// Rotary embedding of one token's heads, pairs of adjacent values (GGUF llama weights are permuted for it, and
    /// Hugging Face ones at load, see [`hf`]).
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

    /// Causal attention of every segment's new queries over its cache (which already holds their own keys and
    /// values, past its `len`). One task per (segment, kv head, tile of up to [`TILE`] new tokens): the task
    /// streams the kv head's blocks once for every query head that shares it (grouped-query attention without
    /// copies) and every token of the tile, with an online softmax. Sequences of different lengths never need
    /// padding or masks between them, and a row's result depends only on its own sequence.
    fn attention(&self, layer: usize, q: &[f32], segments: &[Segment<'_>]) -> Vec<f32> {
        let cfg = &self.config;
        let (hd, group) = (cfg.head_dim, cfg.heads / cfg.kv_heads);
        let mut starts = Vec::with_capacity(segments.len());
        let mut offset = 0;
        for s in segments {
            starts.push(offset);
            offset += s.tokens.len();
        }
        let tasks: Vec<(usize, usize, usize)> = (0..segments.len())
            .flat_map(|si| {
                let tiles = segments[si].tokens.len().div_ceil(TILE);
                (0..cfg.kv_heads).flat_map(move |kv| (0..tiles).map(move |tile| (si, kv, tile * TILE)))
            })
            .collect();
        let results: Vec<Vec<f32>> =
            tasks.par_iter().map(|&(si, kv, t0)| self.attend_tile(layer, q, starts[si], &segments[si], kv, t0)).collect();
        // Rows as wide as the laid-out attention output, the padding zero.
        let row = self.attn_width;
        let mut attn = vec![0f32; offset * row];
        for (&(si, kv, t0), out) in tasks.iter().zip(results) {
            // `out` is [token][group][head_dim]; query head `kv * group + g` uses kv head `kv`.
            for (i, chunk) in out.chunks_exact(group * hd).enumerate() {
                attn[(starts[si] + t0 + i) * row + kv * group * hd..][..group * hd].copy_from_slice(chunk);
            }
        }
        attn
    }

    /// Attention of new tokens `t0..t0 + TILE` of one segment (those that exist), every query head of kv head
    /// `kv`: `[token][group][head_dim]`.
    fn attend_tile(&self, layer: usize, q: &[f32], start: usize, s: &Segment<'_>, kv: usize, t0: usize) -> Vec<f32> {
        let cfg = &self.config;
        let (hd, group) = (cfg.head_dim, cfg.heads / cfg.kv_heads);
        let q_row = cfg.heads * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let new = s.tokens.len();
        let total = s.cache.len + new;
        let t1 = (t0 + TILE).min(new);
        let rows = (t1 - t0) * group;
        let host = s.cache.host();
        let (keys, values) = (&host.keys[layer], &host.values[layer]);
        // Row r is token t0 + r / group, query head kv * group + r % group; it sees positions below `visible`.
        let visible = |r: usize| total - new + t0 + r / group + 1;
        let query = |r: usize| &q[(start + t0 + r / group) * q_row + (kv * group + r % group) * hd..][..hd];
        let mut max = vec![f32::NEG_INFINITY; rows];
        let mut sum = vec![0f32; rows];
        let mut out = vec![0f32; rows * hd];
        for b in 0..visible(rows - 1).div_ceil(BLOCK) {
            let kt = &keys[b][kv * hd * BLOCK..][..hd * BLOCK];
            let vb = &values[b][kv * BLOCK * hd..][..BLOCK * hd];
            for r in 0..rows {
                let valid = visible(r).saturating_sub(b * BLOCK).min(BLOCK);
                if valid == 0 {
                    continue;
                }
                let qv = query(r);
                let mut scores = [0f32; BLOCK];
                for (d, &qd) in qv.iter().enumerate() {
                    let k = &kt[d * BLOCK..(d + 1) * BLOCK];
                    for c in 0..BLOCK {
                        scores[c] += qd * k[c];
                    }
                }
                let block_max = scores[..valid].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
                let new_max = max[r].max(block_max);
                let correction = (max[r] - new_max).exp();
                let o = &mut out[r * hd..(r + 1) * hd];
                if correction != 1.0 {
                    for x in o.iter_mut() {
                        *x *= correction;
                    }
                }
                sum[r] *= correction;
                for c in 0..valid {
                    let p = (scores[c] * scale - new_max).exp();
                    sum[r] += p;
                    for (x, v) in o.iter_mut().zip(&vb[c * hd..(c + 1) * hd]) {
                        *x += p * v;
                    }
                }
                max[r] = new_max;
            }
        }
        for (o, s) in out.chunks_exact_mut(hd).zip(&sum) {
            let inv = 1.0 / s;
            for x in o {
                *x *= inv;
            }
        }
        out
    }
}

/// New tokens per attention task: each kv block read serves this many tokens times the query group.
const TILE: usize = 8;

/// The fewest rows a dense (f32) matrix product is computed with. candle's f32 matmul (the gemm crate) takes
/// other kernels for a few rows (a matrix-vector product for one row; measured: up to four rows at narrow widths),
/// which round differently, so a sequence's values would depend on how many rows share its step; fewer rows are
/// padded with zero rows. A lone decode step computes eight rows instead of one, which costs little while reading
/// the weights, the same for both, dominates.
const DENSE_MIN_ROWS: usize = 8;

/// `w.forward(x)`, with dense weights computing at least [`DENSE_MIN_ROWS`] rows.
fn product(w: &QMatMul, x: &Tensor) -> candle_core::Result<Tensor> {
    let rows = x.dim(0)?;
    match w {
        QMatMul::Tensor(_) if rows < DENSE_MIN_ROWS && x.device().is_cpu() => w.forward(&x.pad_with_zeros(0, 0, DENSE_MIN_ROWS - rows)?)?.narrow(0, 0, rows),
        _ => w.forward(x),
    }
}

/// Products of one input with several weight matrices (q, k and v; gate and up). On CPU with same-type
/// quantized weights, candle quantizes the input once and runs them in one parallel region; otherwise one by one.
fn matmuls<const N: usize>(x: &Tensor, weights: [&QMatMul; N]) -> candle_core::Result<[Tensor; N]> {
    let tensors: Option<Vec<&QTensor>> = weights.iter().map(|w| if let QMatMul::QTensor(t) = w { Some(t.as_ref()) } else { None }).collect();
    if let Some(tensors) = tensors {
        if let Some(outs) = QTensor::gemv_fused_shared_lhs(&tensors, x)? {
            if let Ok(outs) = <[Tensor; N]>::try_from(outs) {
                return Ok(outs);
            }
        }
    }
    let outs: Vec<Tensor> = weights.iter().map(|w| product(w, x)).collect::<candle_core::Result<_>>()?;
    Ok(outs.try_into().unwrap_or_else(|_| unreachable!("one output per weight")))
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
}
