//! The llama-family decoder: one layer loop over an attention backend, with per-token positions and the KV cache
//! held outside the model. Weights come from a GGUF file ([`gguf`]) or a Hugging Face directory ([`hf`]);
//! [`inspect`] and [`Model::load`] tell them apart by whether the path is a directory.
//!
//! One forward pass takes a list of [`Segment`]s: each is a run of new tokens of one sequence, starting at that
//! sequence's current length. A prefill is a segment of a whole prompt; a decode step is a segment of one token;
//! several of both are packed into one pass, so every weight matrix is read once per step for all of them.
//!
//! [`Model::forward_step`] is the layer loop: norms, projections and the feed-forward network are the model's,
//! and each layer's attention is an [`Attention`] backend's (`engine::attention`: the CPU's host backend or the
//! paged pool), which sees the model through [`AttentionModel`].

mod embedding;
pub mod gguf;
pub mod hf;
pub(crate) mod layers;

use std::path::Path;

use candle_core::quantized::QMatMul;

use crate::engine::kernels::Matrix;
use candle_core::{DType, Device, Tensor, D};

use embedding::Embedding;
use layers::Layer;
use super::gemma::{self, GemmaConfig, PostNorms};
use super::moe::MoeConfig;
use super::lanes::{product, rms_norm, HostLane, TensorLane};
use super::{DecoderModel, StepLogits, StepModel};
use crate::engine::attention::{Attention, AttentionModel, AttentionShape, KvCache, Segment, SlidingWindow};
use crate::engine::parallel::{Rank, RankSlice};
use crate::engine::ModelError;
use crate::job::{ComputeDtype, CpuWeights};
use crate::tokenize::VocabMetadata;
pub use gguf::Layout;

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
    /// The values of each head RoPE rotates, from its start: `head_dim`, or fewer where the model rotates part of
    /// each head (`partial_rotary_factor`, Phi-4-mini's 96 of 128; GGUF's `rope.dimension_count`). The rest pass
    /// through unrotated (their pairs' frequency is 0: cos 1, sin 0, exactly the identity).
    pub rotary_dim: usize,
    pub ffn_size: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// Llama 3's rescaling of the RoPE frequencies, when the checkpoint declares it.
    pub rope_scaling: Option<RopeScaling>,
    /// A divisor of each rotated pair's RoPE frequency (`rotary_dim / 2` of them): a GGUF file's `rope_freqs` tensor
    /// (Llama 3.1's scaling as llama.cpp's converter stores it), linear scaling's factor, LongRoPE's factors.
    pub rope_freq_factors: Option<Vec<f32>>,
    pub vocab_size: usize,
    /// Gemma 2 and 3's additions ([`gemma`]); `None` in the llama-shaped families.
    pub gemma: Option<GemmaConfig>,
    /// Sliding-window layers, where the attention backends slide (Gemma, Phi-3).
    pub sliding: Option<super::Sliding>,
    /// A mixture of experts in every layer's feed-forward network (Mixtral, Qwen3-MoE), each expert's network
    /// `ffn_size` wide.
    pub moe: Option<MoeConfig>,
    /// LongRoPE (Phi-3's 128k-context models, Phi-3.5): which factor set divides the frequencies (in
    /// `rope_freq_factors`) and the attention factor q and k are scaled by.
    pub long_rope: Option<LongRope>,
}

/// LongRoPE's choice, as llama.cpp makes it: the long factors when the context served exceeds the context the model
/// was pre-trained at (`original_context`), the short ones otherwise, for every position (so a sequence's keys never
/// change rotation as it grows); and the attention factor (`sqrt(1 + ln(context / original) / ln(original))`, or
/// the file's), which multiplies both q and k after rotation: here the scores' scale, by its square.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    pub long: bool,
    pub original_context: usize,
    pub attn_factor: f32,
}

impl LongRope {
    /// One line for `validate` and the load log.
    pub fn describe(&self) -> String {
        let set = if self.long { "long" } else { "short" };
        format!("LongRoPE: the {set} factors (pre-trained context {}), attention factor {}", self.original_context, self.attn_factor)
    }
}

impl ModelConfig {
    /// One line for `validate` and the load log where RoPE rotates part of each head.
    pub fn partial_rotary(&self) -> Option<String> {
        (self.rotary_dim < self.head_dim).then(|| format!("RoPE on the first {} of each head's {} values (the rest unrotated)", self.rotary_dim, self.head_dim))
    }

    /// Bytes of one block of [`KV_BLOCK_TOKENS`] positions of a sequence's cache, every layer's keys and values
    /// held in `kv_dtype`.
    pub fn kv_block_bytes(&self, kv_dtype: DType) -> usize {
        crate::engine::attention::kv_block_bytes(self.layers, self.kv_heads, self.head_dim, kv_dtype)
    }

    /// The attention's shape, its output `out_width` wide in memory.
    pub fn attention_shape(&self, out_width: usize) -> AttentionShape {
        let mut shape = AttentionShape {
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            context_length: self.context_length,
            out_width,
            rope_frequencies: rope_frequencies(self),
            scale: AttentionShape::default_scale(self.head_dim),
            softcap: None,
            sliding: None,
        };
        if let Some(gemma) = &self.gemma {
            gemma.shape_attention(&mut shape);
        }
        if let Some(l) = &self.long_rope {
            shape.scale *= l.attn_factor * l.attn_factor;
        }
        shape.sliding = self.sliding.as_ref().map(|s| SlidingWindow {
            window: s.window,
            layers: s.layers.clone(),
            // Local layers of their own base rotate with it, unscaled (llama.cpp's `rope_freq_scale_train_swa` is 1);
            // others as the global layers.
            rope_frequencies: (s.rope_base != self.rope_base)
                .then(|| rope_frequencies(&ModelConfig { rope_base: s.rope_base, rope_scaling: None, rope_freq_factors: None, ..self.clone() })),
        });
        shape
    }
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
    /// The weights' bytes as the file stores them.
    pub weights: StoredWeights,
}

/// A model's weights as its files store them: every tensor's bytes, and the routed experts' share (a mixture's
/// `ffn_*_exps` in GGUF, `*.experts.*` in Hugging Face names; a shared expert, which every token computes, is not
/// counted there). What `validate` and `run` hold against the memory available before any weight is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoredWeights {
    pub bytes: u64,
    pub experts: u64,
}

impl StoredWeights {
    /// Counts tensor `name` of `bytes` bytes.
    pub fn add(&mut self, name: &str, bytes: u64) {
        self.bytes = self.bytes.saturating_add(bytes);
        if name.contains("_exps.") || name.contains(".experts.") {
            self.experts = self.experts.saturating_add(bytes);
        }
    }
}

pub struct Model {
    pub config: ModelConfig,
    device: Device,
    /// Widths as laid out in memory: the hidden state and the attention output, each zero-padded to a multiple of
    /// 256 on CPU (see [`Layout`]); equal to the model's widths otherwise.
    width: usize,
    /// The attention as its backends see it (its output `attn_width` wide).
    attention: AttentionShape,
    embedding: Embedding,
    layers: Vec<Layer>,
    /// Gemma's norms after attention and after the feed-forward network, per layer (empty in other families).
    post_norms: Vec<PostNorms>,
    output_norm: Tensor,
    /// The output projection; `None` on a tensor-parallel rank but the first, which computes no logits.
    lm_head: Option<Matrix>,
    /// How the weights are laid out in memory.
    layout: Layout,
    /// This model's rank, where it is one slice of a tensor-parallel model ([`crate::engine::parallel`]).
    rank: Option<Rank>,
    /// Whether the embedding table is another rank's ([`Model::share_embedding`]), counted there.
    embedding_shared: bool,
    /// Whether the layer loop runs on host vectors ([`HostLane`]): an f32 model on the CPU whose matrices are all
    /// the kernels' (its layers' vectors then kept in host memory too).
    host_loop: bool,
}

/// The weights of a [`Model`], as a loader hands them over.
struct Weights {
    embedding: Embedding,
    layers: Vec<Layer>,
    post_norms: Vec<PostNorms>,
    output_norm: Tensor,
    lm_head: Option<Matrix>,
    /// The attention output's width in memory (the input width of each layer's `wo`).
    attn_width: usize,
    layout: Layout,
}

/// The rotary frequency of each pair of a head's values, `base^(-2i / rotary_dim)` for the `rotary_dim / 2` pairs
/// RoPE rotates (0 for the rest: they pass through), with Llama 3's rescaling when the model declares it (as Hugging
/// Face's `_compute_llama3_parameters`).
fn rope_frequencies(config: &ModelConfig) -> Vec<f64> {
    let (hd, rotated) = (config.head_dim, config.rotary_dim);
    (0..hd / 2)
        .map(|i| {
            if i >= rotated / 2 {
                return 0.0;
            }
            let freq = 1.0 / (config.rope_base as f64).powf(2.0 * i as f64 / rotated as f64);
            let freq = match &config.rope_freq_factors {
                Some(factors) => freq / f64::from(factors[i]),
                None => freq,
            };
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


impl DecoderModel for Model {
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn context_length(&self) -> usize {
        self.config.context_length
    }

    /// The weights were uploaded from the thread that loaded them; cudarc binds the context on most calls too, and
    /// this makes the engine thread's ownership explicit.
    fn bind_to_thread(&self) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = &self.device {
            cuda.cuda_stream().context().bind_to_thread().map_err(|e| candle_core::Error::Msg(format!("cannot bind the CUDA context: {e}")))?;
        }
        Ok(())
    }
    /// Every layer's routing counters, taken and summed per expert index.
    fn take_routing(&self) -> Option<(Vec<u64>, f64)> {
        let moe = self.config.moe.as_ref()?;
        let (mut tokens, mut seconds) = (vec![0u64; moe.experts], 0.0);
        for layer in &self.layers {
            if let layers::Ffn::Experts(experts) = &layer.ffn {
                let (t, s) = experts.routing.take();
                tokens.iter_mut().zip(t).for_each(|(a, b)| *a += b);
                seconds += s;
            }
        }
        Some((tokens, seconds))
    }
}

impl<A: Attention> StepModel<A> for Model {
    fn forward_step_timed(
        &self,
        attention: &A,
        segments: &mut [Segment<'_, A::Cache>],
        outputs: &[usize],
        greedy: &[bool],
    ) -> candle_core::Result<(Vec<Vec<StepLogits>>, std::time::Duration)> {
        let cfg = &self.config;
        let started = std::time::Instant::now();
        let (positions, tokens) = self.check_segments(segments, outputs)?;
        let step = attention.begin(segments, &positions)?;
        let inputs = started.elapsed();
        let n = tokens.len();
        let ids = Tensor::from_vec(tokens, n, &self.device)?;
        let mut x = self.embedding.lookup(&ids)?;
        if cfg.gemma.is_some() {
            x = (x * f64::from(GemmaConfig::embedding_scale(cfg.hidden_size)))?;
        }
        // RMSNorm over the laid-out width, with epsilon scaled as the weights were (see `gguf::padded_norm`).
        let eps = (cfg.rms_eps * (cfg.hidden_size as f32 / self.width as f32), cfg.rms_eps);
        x = match self.host_loop && attention.host_vectors() {
            true => {
                let (rows, width) = x.dims2()?;
                let x = self.layer_loop(&HostLane { rows, tp: self.rank.as_ref() }, attention, &step, segments, x.flatten_all()?.to_vec1::<f32>()?, eps)?;
                Tensor::from_vec(x, (rows, width), &self.device)?
            }
            false => self.layer_loop(&TensorLane { tp: self.rank.as_ref() }, attention, &step, segments, x, eps)?,
        };
        attention.advance(segments);
        // A tensor-parallel model's logits are its first rank's.
        if self.rank.as_ref().is_some_and(|r| !r.heads_output()) {
            return Ok((Vec::new(), inputs));
        }
        let logits = self.head(&x, segments, outputs)?;
        Ok((read_back(&logits, outputs, if attention.device_argmax() { greedy } else { &[] })?, inputs))
    }
}

impl AttentionModel for Model {
    fn attention_shape(&self) -> &AttentionShape {
        &self.attention
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn dtype(&self) -> DType {
        self.dtype()
    }
}

/// The vocabulary against the model: tokens to tokenize with, and special tokens the embedding has rows for (a BOS
/// outside it would fail the first row mid-job; an empty vocabulary would tokenize every prompt to nothing).
pub(crate) fn check_vocab(vocab: &VocabMetadata, vocab_size: usize) -> Result<(), ModelError> {
    if vocab.tokens.is_empty() || vocab_size == 0 {
        return Err(ModelError::Metadata("the tokenizer's vocabulary is empty".into()));
    }
    let named = [("BOS", vocab.bos), ("EOS", vocab.eos), ("end-of-turn", vocab.eot)];
    let ids = named.into_iter().chain(vocab.more_ends.iter().map(|&id| ("end", Some(id))));
    for (name, id) in ids {
        if let Some(id) = id.filter(|&id| id as usize >= vocab_size) {
            return Err(ModelError::Metadata(format!("the {name} token id {id} is outside the vocabulary of {vocab_size} tokens")));
        }
    }
    Ok(())
}

/// Reads a model's metadata (architecture, shapes, tokenizer) without loading its weights: a GGUF file, or a
/// Hugging Face directory (whose tensors' names and shapes are checked too).
pub fn inspect(path: &Path) -> Result<ModelInfo, ModelError> {
    if path.is_dir() {
        return hf::inspect(path);
    }
    gguf::inspect(path)
}

impl Model {
    /// Loads a llama-family model onto `device` as stored: a GGUF file (the default `runtime.cpu_weights`), or a
    /// Hugging Face directory ([`hf`]).
    pub fn load(path: &Path, device: &Device) -> Result<(Model, ModelInfo), ModelError> {
        Model::load_as(path, device, CpuWeights::default(), ComputeDtype::Auto)
    }

    /// Loads a llama-family model onto `device`, a GGUF file in the layout `weights` asks for ([`Layout::choose`]),
    /// a Hugging Face directory in the dtype `dtype` asks for ([`hf::compute_dtype`]; a GGUF file ignores it: the
    /// job's check refuses anything but `auto` for one).
    pub fn load_as(path: &Path, device: &Device, weights: CpuWeights, dtype: ComputeDtype) -> Result<(Model, ModelInfo), ModelError> {
        if path.is_dir() {
            return hf::load(path, device, Some(hf::compute_dtype(device, dtype)), weights, None, None);
        }
        gguf::load(path, device, |config| Layout::choose(device, config, weights), None, None)
    }

    /// Loads a Hugging Face directory with its weights and activations in `dtype` (anything but f32 runs on the
    /// paged backend, the only one that computes in other dtypes).
    pub fn load_hf_as(dir: &Path, device: &Device, dtype: DType) -> Result<(Model, ModelInfo), ModelError> {
        hf::load(dir, device, Some(dtype), CpuWeights::default(), None, None)
    }

    /// Loads a GGUF llama-family model in exactly the given weight layout, for comparisons. A Hugging Face
    /// directory has one layout, dense weights, and ignores `layout`.
    pub fn load_with(path: &Path, device: &Device, layout: Layout) -> Result<(Model, ModelInfo), ModelError> {
        if path.is_dir() {
            return hf::load(path, device, None, CpuWeights::F32, None, None);
        }
        gguf::load(path, device, |_| layout, None, None)
    }

    /// Loads tensor-parallel rank `rank`'s slice of a llama-family model (`slice`, of [`crate::engine::parallel::split_heads`]'s),
    /// as [`Model::load_as`] loads the whole. The returned [`ModelInfo`] is the whole model's.
    /// `first`: the first rank's model, on the same device, whose embedding table this rank shares
    /// ([`Model::share_embedding`]) instead of reading its own.
    pub fn load_rank(path: &Path, device: &Device, weights: CpuWeights, dtype: ComputeDtype, slice: &RankSlice, rank: Rank, first: Option<&Model>) -> Result<(Model, ModelInfo), ModelError> {
        let shared = first.filter(|f| f.device.same_device(device)).map(|f| &f.embedding);
        let (mut model, info) = match path.is_dir() {
            true => hf::load(path, device, Some(hf::compute_dtype(device, dtype)), weights, Some(slice), shared)?,
            false => gguf::load(path, device, |config| Layout::choose(device, config, weights), Some(slice), shared)?,
        };
        if let Some(first) = first.filter(|_| shared.is_some()) {
            model.share_embedding(first).map_err(|e| ModelError::Metadata(e.to_string()))?;
        }
        tracing::info!(architecture = %info.config.architecture, "{}", slice.describe(info.config.head_dim, info.config.ffn_size));
        model.rank = Some(rank);
        Ok((model, info))
    }

    /// How the weights are laid out in memory: as stored, or requantized for the CPU's kernels.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// What the weights compute, as the log, the metrics' `weights_layout` and the results' numerics name it: the
    /// layout's name, or, where the AMX level's bf16 tiles or the AVX-512 BF16 level's dot products take this
    /// model's bf16 matrices (which round the activations of their products to bf16), or the tiles its F16 matrices
    /// (which split weights and activations into bf16 parts), a name that says so.
    pub fn weights_name(&self) -> &'static str {
        use candle_core::quantized::GgmlDType;
        let tiles = self.device.is_cpu() && crate::engine::kernels::amx_bf16_tiles();
        let dots = self.device.is_cpu() && crate::engine::kernels::avx512_bf16_dots();
        let holds = |dtype: GgmlDType| {
            let stored = |m: &Matrix| matches!(m, Matrix::Packed(p) if p.stored_dtype() == dtype);
            self.lm_head.iter().any(stored) || self.layers.iter().any(|l| l.matrices().into_iter().any(stored))
        };
        let any = |dtype: GgmlDType| tiles && holds(dtype);
        if dots && holds(GgmlDType::BF16) {
            return match self.layout {
                Layout::Stored16(_) => "bf16 as stored, on AVX-512 BF16 dot products (activations rounded to bf16)",
                _ => "as-stored, bf16 matrices on AVX-512 BF16 dot products (activations rounded to bf16)",
            };
        }
        match (any(GgmlDType::BF16), any(GgmlDType::F16), self.layout) {
            (false, false, layout) => layout.name(),
            (true, false, Layout::Stored16(_)) => "bf16 as stored, on AMX bf16 tiles (activations rounded to bf16)",
            (false, true, Layout::Stored16(_)) => "f16 as stored, on AMX bf16 tiles (weights and activations as two bf16 parts each)",
            (true, false, _) => "as-stored, bf16 matrices on AMX bf16 tiles (activations rounded to bf16)",
            (false, true, _) => "as-stored, F16 matrices on AMX bf16 tiles (weights and activations as two bf16 parts each)",
            (true, true, _) => "as-stored, bf16 and F16 matrices on AMX bf16 tiles (bf16's activations rounded to bf16, F16's weights and activations as two bf16 parts each)",
        }
    }

    /// A model from its weights. `weights.embedding`'s width is the hidden state's width in memory.
    fn assemble(config: ModelConfig, device: &Device, weights: Weights) -> Model {
        // What the loader read and freed (the file's copies, a table as stored) goes back to the system.
        crate::alloc::release_free_memory();
        let Weights { embedding, layers, mut post_norms, output_norm, lm_head, attn_width, layout } = weights;
        tracing::info!(architecture = %config.architecture, embedding = %embedding.describe(), "token embedding table");
        if let Some(gemma) = &config.gemma {
            tracing::info!(architecture = %config.architecture, "{}", gemma.describe());
        }
        if let Some(sliding) = &config.sliding {
            tracing::info!(architecture = %config.architecture, "{}", sliding.describe());
        }
        if let Some(moe) = &config.moe {
            tracing::info!(architecture = %config.architecture, "{}", moe.describe());
        }
        if let Some(l) = &config.long_rope {
            tracing::info!(architecture = %config.architecture, "{}", l.describe());
        }
        if let Some(partial) = config.partial_rotary() {
            tracing::info!(architecture = %config.architecture, "{partial}");
        }
        let mut layers = layers;
        let host_loop = device.is_cpu()
            && embedding.dtype() == DType::F32
            && layers.iter().all(|l| l.matrices().iter().all(|m| matches!(m, Matrix::Packed(_))))
            && layers.iter_mut().try_for_each(Layer::keep_host).is_ok()
            && post_norms.iter_mut().flat_map(PostNorms::vectors_mut).try_for_each(super::lanes::Vector::keep_host).is_ok();
        Model {
            host_loop,
            width: embedding.width().unwrap_or(config.hidden_size),
            attention: config.attention_shape(attn_width),
            config,
            device: device.clone(),
            embedding,
            layers,
            post_norms,
            output_norm,
            lm_head,
            layout,
            rank: None,
            embedding_shared: false,
        }
    }

    /// The family's layer loop over `lane`.
    fn layer_loop<L: super::lanes::Lane, A: Attention>(
        &self,
        lane: &L,
        attention: &A,
        step: &A::Step,
        segments: &mut [Segment<'_, A::Cache>],
        x: L::X,
        eps: (f32, f32),
    ) -> candle_core::Result<L::X> {
        match self.config.gemma {
            Some(_) => gemma::run(lane, &self.layers, &self.post_norms, attention, step, segments, x, eps),
            None => layers::run(lane, &self.layers, attention, step, segments, x, eps),
        }
    }

    /// Whether a CPU step keeps its activations in host memory through the layers ([`layers::HostLane`]).
    pub fn host_loop(&self) -> bool {
        self.host_loop
    }

    /// The same model with every layer on candle tensors, for comparing the two layer loops.
    pub fn with_tensor_loop(mut self) -> Model {
        self.host_loop = false;
        self
    }

    /// The activations' dtype (and the paged KV cache's).
    pub fn dtype(&self) -> DType {
        self.embedding.dtype()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Takes `other`'s embedding table in place of its own, the same values (tensor-parallel ranks in one process:
    /// the table is replicated, and one copy serves them all). Err when the tables differ in shape or place.
    pub fn share_embedding(&mut self, other: &Model) -> candle_core::Result<()> {
        if !self.embedding.alike(&other.embedding) || !self.device.same_device(&other.device) {
            candle_core::bail!("the ranks' embedding tables differ (a bug)");
        }
        self.embedding = other.embedding.clone();
        self.embedding_shared = true;
        Ok(())
    }

    /// Bytes of weights held on the device (quantized sizes as stored; a tied output projection once; an embedding
    /// table shared with another rank not at all).
    pub fn weight_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let lm_head = match &self.lm_head {
            Some(Matrix::Candle(QMatMul::Tensor(t))) if self.embedding.is(t) => 0,
            Some(m) if self.embedding.holds(m) => 0,
            Some(other) => other.bytes(),
            None => 0,
        };
        (if self.embedding_shared { 0 } else { self.embedding.bytes() })
            + dense(&self.output_norm)
            + self.post_norms.iter().map(PostNorms::bytes).sum::<usize>()
            + lm_head
            + self
                .layers
                .iter()
                .map(|l| {
                    l.vector_bytes() + l.matrices().into_iter().map(Matrix::bytes).sum::<usize>()
                })
                .sum::<usize>()
    }

    /// Runs the new tokens of every segment through the model, appending their keys and values to each segment's
    /// cache, and returns the logits after the last token of each segment, `[segments][vocab]`.
    pub fn forward<A: Attention>(&self, attention: &A, segments: &mut [Segment<'_, A::Cache>]) -> candle_core::Result<Vec<Vec<f32>>> {
        let outputs = vec![1; segments.len()];
        Ok(self.forward_outputs(attention, segments, &outputs)?.into_iter().map(|mut rows| rows.remove(0)).collect())
    }

    /// As [`Model::forward`], with the logits of the last `outputs[i]` positions of segment `i` (in position
    /// order): prompt scoring needs the next-token distribution after every token of a completion.
    pub fn forward_outputs<A: Attention>(
        &self,
        attention: &A,
        segments: &mut [Segment<'_, A::Cache>],
        outputs: &[usize],
    ) -> candle_core::Result<Vec<Vec<Vec<f32>>>> {
        let rows = self.forward_step(attention, segments, outputs, &[])?;
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

    /// The layer loop, for the engine: the logits of the last `outputs[i]` positions of segment `i`, where
    /// `greedy[i]` (where given) says segment `i` (with one output) needs only its argmax. A backend that chooses
    /// greedy tokens on the device ([`Attention::device_argmax`]) returns [`StepLogits::Argmax`] for those rows
    /// and reads back one token each; otherwise every row comes back as logits, its argmax being a pass over them.
    pub fn forward_step<A: Attention>(
        &self,
        attention: &A,
        segments: &mut [Segment<'_, A::Cache>],
        outputs: &[usize],
        greedy: &[bool],
    ) -> candle_core::Result<Vec<Vec<StepLogits>>> {
        Ok(StepModel::forward_step_timed(self, attention, segments, outputs, greedy)?.0)
    }

    /// Checks a step's segments (outputs, context, vocabulary); returns every new token's position and id, in
    /// order.
    fn check_segments<C: KvCache>(&self, segments: &[Segment<'_, C>], outputs: &[usize]) -> candle_core::Result<(Vec<usize>, Vec<u32>)> {
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
    fn head<C>(&self, x: &Tensor, segments: &[Segment<'_, C>], outputs: &[usize]) -> candle_core::Result<Tensor> {
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
        let x = rms_norm(&x, &self.output_norm, eps)?;
        // candle's Q6_K takes its fast kernel only for two rows or more, and the two kernels round differently:
        // a lone row gets a zero row beside it, so a sequence's logits never depend on how many share its step.
        let rows = x.dim(0)?;
        let lm_head = self.lm_head.as_ref().ok_or_else(|| candle_core::Error::Msg("a tensor-parallel rank without the output projection computed logits (a bug)".into()))?;
        let logits = match rows == 1 && self.device.is_cpu() && matches!(lm_head, Matrix::Candle(_)) {
            true => product(lm_head, &Tensor::cat(&[&x, &x.zeros_like()?], 0)?)?.narrow(0, 0, 1)?,
            false => product(lm_head, &x)?,
        };
        // Gemma's final soft-capping, as llama.cpp computes it: scaled by 1 / cap, tanh, scaled by cap, in f32 (in
        // bf16 every logit past about twice the cap rounds to the cap itself, 30.0, and the argmax becomes the first
        // of the tied: the GPU check's Gemma 2 picked another token than the f32 reference at every position).
        match cfg.gemma.as_ref().and_then(|g| g.final_softcap) {
            Some(cap) => (logits.to_dtype(DType::F32)? * (1.0 / f64::from(cap)))?.tanh()? * f64::from(cap),
            None => Ok(logits),
        }
    }
}

/// The step's output rows read back: for the rows `greedy` marks (one output each), the argmax computed where the
/// logits are and one `u32` read back; for the others, their logits as f32.
fn read_back(logits: &Tensor, outputs: &[usize], greedy: &[bool]) -> candle_core::Result<Vec<Vec<StepLogits>>> {
    let mut first = Vec::with_capacity(outputs.len());
    let mut at = 0;
    for &o in outputs {
        first.push(at);
        at += o;
    }
    debug_assert_eq!(logits.dim(0)?, at);
    let greedy_rows: Vec<u32> = (0..outputs.len()).filter(|&i| greedy.get(i) == Some(&true) && outputs[i] == 1).map(|i| first[i] as u32).collect();
    let full_rows: Vec<u32> = (0..at as u32).filter(|r| greedy_rows.binary_search(r).is_err()).collect();
    let tokens = match greedy_rows.is_empty() {
        true => Vec::new(),
        false => select_rows(logits, &greedy_rows)?.argmax(D::Minus1)?.to_vec1::<u32>()?,
    };
    let mut full = match full_rows.is_empty() {
        true => Vec::new(),
        false => select_rows(logits, &full_rows)?.to_dtype(DType::F32)?.to_vec2::<f32>()?,
    }
    .into_iter();
    let mut tokens = tokens.into_iter();
    Ok((0..outputs.len())
        .map(|i| match greedy_rows.binary_search(&(first[i] as u32)) {
            Ok(_) => vec![StepLogits::Argmax(tokens.next().expect("one token per greedy row"))],
            Err(_) => full.by_ref().take(outputs[i]).map(StepLogits::Full).collect(),
        })
        .collect())
}

/// Rows of a 2-D tensor: a narrow when they are a run, a gather otherwise.
fn select_rows(t: &Tensor, rows: &[u32]) -> candle_core::Result<Tensor> {
    let first = rows.first().copied().unwrap_or(0) as usize;
    if rows.iter().enumerate().all(|(i, &r)| r as usize == first + i) {
        return t.narrow(0, first, rows.len());
    }
    t.index_select(&Tensor::from_vec(rows.to_vec(), rows.len(), t.device())?, 0)
}
