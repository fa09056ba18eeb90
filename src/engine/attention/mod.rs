//! Attention backends and their KV caches, shared by every decoder family. A family's layer loop hands each
//! layer's queries, keys and values to an [`Attention`] backend, which rotates them (RoPE at each token's own
//! position), writes the keys and values into its own cache type and attends. Two backends:
//! - [`HostAttention`] ([`host`]): the CPU's. Blocked f32 (or 16-bit) caches in host memory, attention in plain
//!   Rust, parallel over (segment, kv head, tile of new tokens), computing each block in place.
//! - [`PagedAttention`] ([`paged`]): every accelerator's (and the CPU's when asked, `runtime.attention =
//!   "paged-tiled"`, which is how the CPU tests run the loop GPUs run). A device pool of blocks in the activations'
//!   dtype, attention in candle tensor ops (the tiles), nightshift's CUDA decode kernel for the decodes
//!   ([`decode`], `paged-decode`) or flash-attention's paged kernel (`paged-flash`).
//!
//! A backend sees a model only through [`AttentionModel`]: its [`AttentionShape`], device and dtype.
//! [`AttentionPlan::choose`] picks the backend for a loaded model and the job's `runtime.attention`.

#[cfg(target_arch = "x86_64")]
mod amx;
pub mod decode;
pub mod host;
pub mod paged;
mod tile;

use candle_core::{DType, Device, Tensor};

use crate::job::{AttentionChoice, KvCacheDtype};
pub use host::{HostAttention, HostCache};
pub use paged::{PagedAttention, PagedCache};

/// Positions per block of the KV cache: the width of the host backend's score vectors, and the unit the
/// scheduler books and the prefix cache keeps. 32 in a build with flash-attention, whose paged kernel takes
/// blocks of a multiple of 32 positions.
pub const KV_BLOCK_TOKENS: usize = if cfg!(feature = "flash-attn") { 32 } else { 16 };
const BLOCK: usize = KV_BLOCK_TOKENS;

/// A decoder's attention as its backends see it.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionShape {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The most positions a sequence holds: the rotary tables' length.
    pub context_length: usize,
    /// The attention output's width in memory: `heads x head_dim`, or wider where the weights' layout pads it (the
    /// padding is zero).
    pub out_width: usize,
    /// The rotary frequency of each pair of a head's values (`head_dim / 2` of them), the family's scaling applied.
    pub rope_frequencies: Vec<f64>,
    /// What scores are multiplied by before the softmax: `1 / sqrt(head_dim)`, or the family's
    /// (`query_pre_attn_scalar`'s in Gemma).
    pub scale: f32,
    /// Soft-capping of the scaled scores, `cap x tanh(score / cap)` (Gemma 2's attention logits).
    pub softcap: Option<f32>,
    /// Sliding-window attention in some or all layers (Mistral, Gemma 2 and 3).
    pub sliding: Option<SlidingWindow>,
}

/// Layers whose queries see only the last `window` positions (their own included), each with the RoPE frequencies
/// of local layers (Gemma 3's base of 10,000 where its global layers have 1,000,000).
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    /// Per layer, whether it is a sliding-window one.
    pub layers: Vec<bool>,
    /// The local layers' rotary frequencies, where they differ from the global layers' (Gemma 3's).
    pub rope_frequencies: Option<Vec<f64>>,
}

impl AttentionShape {
    /// Bytes of one block of [`KV_BLOCK_TOKENS`] positions of a sequence's cache, every layer's keys and values
    /// held in `kv_dtype`.
    pub fn kv_block_bytes(&self, kv_dtype: DType) -> usize {
        kv_block_bytes(self.layers, self.kv_heads, self.head_dim, kv_dtype)
    }

    /// `1 / sqrt(head_dim)`: the scale of scores unless a family says otherwise.
    pub fn default_scale(head_dim: usize) -> f32 {
        1.0 / (head_dim as f32).sqrt()
    }

    /// The window every layer's attention slides over, where every layer's does (Mistral v0.1, Phi-3): no query
    /// reads a position that far behind it, so a sequence's KV blocks before it can be given back
    /// ([`Attention::release_before`]). `None` where any layer attends to every position (Gemma's global layers).
    pub fn window_of_every_layer(&self) -> Option<usize> {
        self.sliding.as_ref().filter(|s| s.layers.len() == self.layers && s.layers.iter().all(|&l| l)).map(|s| s.window)
    }

    /// The window of layer `layer`'s attention, if it is a sliding-window layer.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding.as_ref().filter(|s| s.layers.get(layer) == Some(&true)).map(|s| s.window)
    }

    /// Which RoPE table layer `layer` uses, of [`AttentionShape::rope_sets`]'s: 0 the global one, 1 the local
    /// layers' (where they differ).
    pub fn rope_set(&self, layer: usize) -> usize {
        match &self.sliding {
            Some(s) if s.layers.get(layer) == Some(&true) && s.rope_frequencies.is_some() => 1,
            _ => 0,
        }
    }

    /// The RoPE tables ([`rope_tables`]) of every set of frequencies layers use: the global one,
    /// and the local layers' where they differ.
    fn rope_sets(&self) -> Vec<(Vec<f32>, Vec<f32>)> {
        let mut sets = vec![rope_tables(&self.rope_frequencies, self.context_length)];
        if let Some(local) = self.sliding.as_ref().and_then(|s| s.rope_frequencies.as_ref()) {
            sets.push(rope_tables(local, self.context_length));
        }
        sets
    }
}

/// cos and sin of position x frequency, `[context_length][head_dim / 2]` each, in f32: the RoPE tables both backends
/// use.
fn rope_tables(frequencies: &[f64], context_length: usize) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(context_length * frequencies.len());
    let mut sin = Vec::with_capacity(context_length * frequencies.len());
    for pos in 0..context_length {
        for freq in frequencies {
            let angle = pos as f64 * freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Bytes of one block of [`KV_BLOCK_TOKENS`] positions of a sequence's cache: `layers` layers' keys and values,
/// `kv_heads x head_dim` each, in `kv_dtype`.
pub fn kv_block_bytes(layers: usize, kv_heads: usize, head_dim: usize, kv_dtype: DType) -> usize {
    layers * 2 * kv_heads * head_dim * kv_dtype.size_in_bytes() * BLOCK
}

/// A decoder model as the attention backends see it: its attention's shape, and where and in what dtype it
/// computes (the paged pool holds that dtype).
pub trait AttentionModel {
    fn attention_shape(&self) -> &AttentionShape;
    fn device(&self) -> &Device;
    fn dtype(&self) -> DType;
}

/// New tokens of one sequence for one forward pass, and that sequence's cache (of the backend's kind).
pub struct Segment<'a, C> {
    pub tokens: &'a [u32],
    pub cache: &'a mut C,
}

/// The keys and values of one sequence, all layers, held by a backend ([`Attention::Cache`]).
pub trait KvCache {
    /// Positions held (the sequence's length so far).
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks of [`KV_BLOCK_TOKENS`] positions held (per layer; the same in every layer).
    fn blocks(&self) -> usize;
}

/// An attention backend: it owns a cache type, and for each layer of a step it rotates the new queries and keys,
/// writes the keys and values into the caches and attends. the decoder's layer loop drives it:
/// [`Attention::begin`] once per step, [`Attention::attend`] once per layer, [`Attention::advance`] after the
/// last.
pub trait Attention {
    type Cache: KvCache;
    /// What a step prepares once and every layer reads (positions, block tables, masks).
    type Step;

    /// An empty cache, with room in its block table for `capacity_tokens` (blocks are taken as it fills).
    fn new_cache(&self, capacity_tokens: usize) -> Self::Cache;

    /// A full block of a sequence's cache, held by reference: what the prefix cache keeps and other sequences'
    /// caches start from.
    type Block: Clone + Send;

    /// A copy of a sequence's cache, for a fork (`n` choices). Can fail (a full pool, a device error).
    fn fork(&self, cache: &Self::Cache) -> candle_core::Result<Self::Cache>;

    /// Block `index` of a cache (a full one), to be shared; `None` when there is no such block.
    fn share_block(&self, cache: &Self::Cache, index: usize) -> Option<Self::Block>;

    /// A cache whose first positions are the given full blocks' (shared, not copied), with room in its block table
    /// for `capacity_tokens`.
    fn cache_from_blocks(&self, blocks: Vec<Self::Block>, capacity_tokens: usize) -> Self::Cache;

    /// KV cache bytes of one block of [`KV_BLOCK_TOKENS`] positions, all layers.
    fn block_bytes(&self) -> usize;

    /// Lets go of a cache's first `blocks` blocks (each freed when no other cache or the prefix cache holds it),
    /// every layer's window having passed them ([`AttentionShape::window_of_every_layer`]): no later query reads
    /// them, and [`KvCache::blocks`] no longer counts them. Blocks already let go are skipped.
    fn release_before(&self, cache: &mut Self::Cache, blocks: usize);

    /// Makes room for the step's new positions (`positions`: every new token's, in step order) and builds the
    /// tables every layer uses. Fails, leaving every cache as it was, when the room is not there.
    fn begin(&self, segments: &mut [Segment<'_, Self::Cache>], positions: &[usize]) -> candle_core::Result<Self::Step>;

    /// One layer's attention: `q` `[tokens, heads x head_dim]`, `k` and `v` `[tokens, kv_heads x head_dim]`, before
    /// RoPE. Writes the keys and values at each segment's positions and returns the attention output
    /// `[tokens, width]`, `width` being the model's laid-out attention width (zero-padded past `heads x head_dim`).
    fn attend(&self, step: &Self::Step, layer: usize, qkv: [Tensor; 3], segments: &mut [Segment<'_, Self::Cache>]) -> candle_core::Result<Tensor>;

    /// Whether the backend attends on host vectors ([`Attention::attend_host`]): the host backend's, so that the
    /// layer loop can keep a CPU step's activations in host memory from the embedding to the head.
    fn host_vectors(&self) -> bool {
        false
    }

    /// [`Attention::attend`] on host vectors: `qkv` `[tokens][heads x head_dim]` and twice `[tokens][kv_heads x
    /// head_dim]`, row-major, before RoPE; returns the attention output `[tokens][width]`. Only for a backend whose
    /// [`Attention::host_vectors`] says so.
    fn attend_host(&self, _step: &Self::Step, _layer: usize, _qkv: [Vec<f32>; 3], _segments: &mut [Segment<'_, Self::Cache>]) -> candle_core::Result<Vec<f32>> {
        candle_core::bail!("this attention backend does not attend on host vectors (a bug)")
    }

    /// After the last layer: every cache holds its segment's new tokens.
    fn advance(&self, segments: &mut [Segment<'_, Self::Cache>]);

    /// Whether a greedy row's token is chosen where the logits are (the decoder reads back one token id instead of
    /// its logits): on an accelerator, yes; on the CPU the logits are in memory already.
    fn device_argmax(&self) -> bool;
}

/// The attention a loaded model runs: its backend and, on the paged one, its kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionPlan {
    pub backend: Backend,
    pub kernel: PagedKernel,
    /// The host backend's prefills on the tile unit (`runtime.attention = "host-amx"`, where it runs).
    pub host_tiles: bool,
}

/// How the paged backend attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PagedKernel {
    /// Every segment in tiles of candle tensor ops (any device).
    Tiles,
    /// Decodes by nightshift's decode kernel, straight from the pool; prefills in tiles. On CUDA the kernel, on
    /// the CPU its reference in Rust (what the tests check the step plan with).
    Decode,
    /// Every segment by flash-attention's varlen paged kernel (`flash-attn` builds, CUDA, f16 or bf16).
    Flash,
}

impl PagedKernel {
    /// The fastest kernel that runs for a model here: flash-attention, else (on CUDA) the decode kernel, else the
    /// tiles. The decode kernel's CPU reference is never chosen on its own: it is for the tests.
    pub fn best(model: &impl AttentionModel) -> PagedKernel {
        if PagedAttention::flash_available(model.device(), model.dtype()) {
            PagedKernel::Flash
        } else if model.device().is_cuda() && PagedAttention::decode_available(model) {
            PagedKernel::Decode
        } else {
            PagedKernel::Tiles
        }
    }
}

impl AttentionPlan {
    /// What `runtime.attention` asks for, for a loaded model: `auto` is [`Backend::for_model`]'s backend with
    /// the fastest paged kernel that runs here (flash-attention, else the CUDA decode kernel, else the tiles); a
    /// named one that cannot run here is refused with a message for the job's author.
    pub fn choose(model: &impl AttentionModel, asked: AttentionChoice) -> Result<AttentionPlan, String> {
        let flash_here = PagedAttention::flash_available(model.device(), model.dtype());
        let decode_here = PagedAttention::decode_available(model);
        let (backend, kernel) = match asked {
            AttentionChoice::Auto => {
                let backend = Backend::for_model(model);
                (backend, if backend == Backend::Paged { PagedKernel::best(model) } else { PagedKernel::Tiles })
            }
            AttentionChoice::Host | AttentionChoice::HostAmx if model.device().is_cpu() && model.dtype() == DType::F32 => (Backend::Host, PagedKernel::Tiles),
            AttentionChoice::Host | AttentionChoice::HostAmx => {
                return Err(format!(
                    "is \"{}\", which computes f32 models on the CPU; this model is in {} on {}: use \"auto\" or \"paged-tiled\"",
                    asked.name(),
                    model.dtype().as_str(),
                    if model.device().is_cpu() { "the CPU" } else { "an accelerator" }
                ))
            }
            AttentionChoice::PagedTiled => (Backend::Paged, PagedKernel::Tiles),
            AttentionChoice::PagedDecode if decode_here => (Backend::Paged, PagedKernel::Decode),
            AttentionChoice::PagedDecode => {
                let shape = model.attention_shape();
                return Err(format!(
                    "is \"paged-decode\", nightshift's decode kernel, which runs on CUDA (or its reference on the CPU) with heads of an even width up to {}, query heads a multiple of kv heads ({} heads of {}, {} kv heads here): use \"auto\" or \"paged-tiled\"",
                    decode::MAX_HEAD_DIM, shape.heads, shape.head_dim, shape.kv_heads
                ));
            }
            AttentionChoice::PagedFlash if flash_here => (Backend::Paged, PagedKernel::Flash),
            AttentionChoice::PagedFlash => {
                return Err(format!(
                    "is \"paged-flash\", which needs a build with the `flash-attn` feature, CUDA and an f16 or bf16 model{}: use \"auto\" or \"paged-tiled\"",
                    if cfg!(feature = "flash-attn") { "" } else { " (this build has no `flash-attn`)" }
                ))
            }
        };
        let head_dim = model.attention_shape().head_dim;
        let host_tiles = asked == AttentionChoice::HostAmx && host::tiles_available(head_dim);
        if asked == AttentionChoice::HostAmx && !host_tiles {
            tracing::warn!(head_dim, "runtime.attention is \"host-amx\", which needs Intel's AMX-BF16 tiles granted by Linux and heads a multiple of 64 wide: the attention runs as \"host\"");
        }
        Ok(AttentionPlan { backend, kernel, host_tiles })
    }

    /// `host`, `host-amx`, `paged-tiled`, `paged-decode` or `paged-flash`, as the log, the metrics and the results' numerics
    /// name it.
    pub fn name(self) -> &'static str {
        match (self.backend, self.kernel) {
            (Backend::Host, _) if self.host_tiles => "host-amx",
            (Backend::Host, _) => "host",
            (Backend::Paged, PagedKernel::Tiles) => "paged-tiled",
            (Backend::Paged, PagedKernel::Decode) => "paged-decode",
            (Backend::Paged, PagedKernel::Flash) => "paged-flash",
        }
    }
}

/// Which attention backend a model runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// [`HostAttention`]: the CPU, in f32.
    Host,
    /// [`PagedAttention`]: every accelerator, any dtype; the CPU when `runtime.attention` asks for it.
    Paged,
}

impl Backend {
    /// The backend `runtime.attention = "auto"` takes for a loaded model: the host backend for an f32 model on
    /// the CPU, the paged one otherwise.
    pub fn for_model(model: &impl AttentionModel) -> Backend {
        if !model.device().is_cpu() || model.dtype() != DType::F32 {
            Backend::Paged
        } else {
            Backend::Host
        }
    }

    /// The dtype of the KV cache a job asks for (`runtime.kv_cache_dtype`) on this backend. The host backend holds
    /// f32 (`auto`: the dtype it computes in), f16 or bf16. The paged backend holds the activations' dtype, which
    /// `auto` names; another is refused with a message for the job's author.
    pub fn kv_dtype(self, model: &impl AttentionModel, asked: KvCacheDtype) -> Result<DType, String> {
        let named = match asked {
            KvCacheDtype::Auto => None,
            KvCacheDtype::F32 => Some(DType::F32),
            KvCacheDtype::F16 => Some(DType::F16),
            KvCacheDtype::Bf16 => Some(DType::BF16),
        };
        match (self, named) {
            (Backend::Host, Some(dtype)) => Ok(dtype),
            (Backend::Host, None) => Ok(DType::F32),
            (Backend::Paged, None) => Ok(model.dtype()),
            (Backend::Paged, Some(dtype)) if dtype == model.dtype() => Ok(dtype),
            (Backend::Paged, Some(_)) => Err(format!(
                "\"{}\" is for the CPU's host backend; on {} the KV cache holds the activations' dtype, {} (\"auto\")",
                asked.name(),
                if model.device().is_cpu() { "the paged backend" } else { "an accelerator" },
                model.dtype().as_str()
            )),
        }
    }

    /// KV cache bytes of one block on this backend, its keys and values held in `kv_dtype` ([`Backend::kv_dtype`]).
    pub fn block_bytes(self, model: &impl AttentionModel, kv_dtype: DType) -> usize {
        model.attention_shape().kv_block_bytes(kv_dtype)
    }

    pub fn is_paged(self) -> bool {
        self == Backend::Paged
    }
}
