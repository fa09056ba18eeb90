//! The host attention backend, the CPU's: each sequence's keys and values in blocks of [`BLOCK`] positions in host
//! memory (f32, or 16 bits where `runtime.kv_cache_dtype` says, widened to f32 a block at a time as attention
//! reads it), RoPE from host tables, and attention in plain Rust, parallel over (segment, kv head, tile of new
//! tokens), computing each block in place: sequences of different lengths never need padding or masks, and a row's
//! result depends only on its own sequence.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::tile::{self, Ahead, CHUNK, CHUNK_BLOCKS};
use super::{Attention, AttentionModel, AttentionShape, KvCache, Segment, BLOCK};
use crate::engine::kernels::elementwise::{narrow_f16, widen_bf16, widen_f16};
use crate::engine::kernels::Level;

/// The host backend: the attention's shape, its RoPE tables and the laid-out width of the attention output.
pub struct HostAttention {
    shape: AttentionShape,
    /// The attention output's width in memory (zero-padded past `heads x head_dim` in a padded layout).
    out_width: usize,
    /// cos and sin of position x frequency, `[context_length][head_dim / 2]` each, per set of frequencies layers
    /// use ([`AttentionShape::rope_set`]).
    rope: Vec<(Vec<f32>, Vec<f32>)>,
    /// How the cache holds keys and values: f32, f16 or bf16.
    kv_dtype: DType,
    block_bytes: usize,
    device: Device,
    /// Prefills on the tile unit (`runtime.attention = "host-amx"`): set only where it runs ([`Self::with_tiles`]).
    tiles: bool,
}

/// One layer's keys or values for one block of positions, in the cache's dtype. 16-bit values are rounded to
/// nearest (ties to even) as they are stored, and widened exactly when read.
#[derive(Clone, Debug)]
enum KvBlock {
    F32(Box<[f32]>),
    F16(Box<[u16]>),
    Bf16(Box<[u16]>),
}

impl KvBlock {
    fn zeroed(dtype: DType, len: usize) -> KvBlock {
        match dtype {
            DType::F16 => KvBlock::F16(vec![0; len].into_boxed_slice()),
            DType::BF16 => KvBlock::Bf16(vec![0; len].into_boxed_slice()),
            _ => KvBlock::F32(vec![0f32; len].into_boxed_slice()),
        }
    }

    /// Stores `values[i]` at `at + i * stride`.
    fn store(&mut self, at: usize, stride: usize, values: &[f32]) {
        match self {
            KvBlock::F32(b) => values.iter().enumerate().for_each(|(i, &v)| b[at + i * stride] = v),
            KvBlock::F16(b) => {
                // Rounded a vector at a time (F16C), then spread out by `stride`.
                let mut narrow = [0u16; 64];
                for (c, chunk) in values.chunks(narrow.len()).enumerate() {
                    narrow_f16(chunk, &mut narrow[..chunk.len()]);
                    let base = at + c * narrow.len() * stride;
                    narrow[..chunk.len()].iter().enumerate().for_each(|(i, &h)| b[base + i * stride] = h);
                }
            }
            KvBlock::Bf16(b) => values.iter().enumerate().for_each(|(i, &v)| b[at + i * stride] = half::bf16::from_f32(v).to_bits()),
        }
    }

    /// The bytes of elements `at..at + len`, for [`Ahead`].
    fn bytes(&self, at: usize, len: usize) -> &[u8] {
        match self {
            KvBlock::F32(b) => bytemuck::cast_slice(&b[at..at + len]),
            KvBlock::F16(b) | KvBlock::Bf16(b) => bytemuck::cast_slice(&b[at..at + len]),
        }
    }

    /// Elements `at..at + len` as f32: borrowed from an f32 block, widened into `scratch` (at least `len` long)
    /// from a 16-bit one.
    fn read<'a>(&'a self, at: usize, len: usize, scratch: &'a mut [f32]) -> &'a [f32] {
        match self {
            KvBlock::F32(b) => &b[at..at + len],
            KvBlock::F16(b) => {
                widen_f16(&b[at..at + len], &mut scratch[..len]);
                &scratch[..len]
            }
            KvBlock::Bf16(b) => {
                widen_bf16(&b[at..at + len], &mut scratch[..len]);
                &scratch[..len]
            }
        }
    }
}

/// One block of [`BLOCK`] positions of a sequence's cache, every layer: per layer, keys `[kv_head][head_dim][BLOCK]`
/// (transposed, so one query's scores against a block are `head_dim` multiply-adds of `BLOCK`-wide vectors, with no
/// horizontal sums) and values `[kv_head][BLOCK][head_dim]`; unused positions are zero.
#[derive(Clone, Debug)]
pub struct HostBlock {
    keys: Vec<KvBlock>,
    values: Vec<KvBlock>,
}

/// A sequence's cache on the host backend: its blocks, each its own allocation, shared by reference between
/// sequences that hold the same positions (a prefix cache hit, the choices of a row) and copied by the first of them
/// that writes into a shared one (only a partly filled block is ever written again). A sequence grows a block at a
/// time without copying what it holds, and holds exactly the blocks the scheduler booked for it.
#[derive(Clone, Debug)]
pub struct HostCache {
    /// Every block from position 0; the first `released` are [`HostCache::released_block`]s, held no longer.
    blocks: Vec<Arc<HostBlock>>,
    released: usize,
    dtype: DType,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    len: usize,
}

impl KvCache for HostCache {
    fn len(&self) -> usize {
        self.len
    }

    fn blocks(&self) -> usize {
        self.blocks.len() - self.released
    }
}

impl HostCache {
    /// What stands in for a block let go ([`Attention::release_before`]): no keys or values, so a read of one (a
    /// bug: the attention reads only blocks inside a window) fails on the bounds check instead of reading stale
    /// values.
    fn released_block() -> Arc<HostBlock> {
        Arc::new(HostBlock { keys: Vec::new(), values: Vec::new() })
    }

    fn block_floats(&self) -> usize {
        self.kv_heads * self.head_dim * BLOCK
    }

    /// Stores the keys and values of positions `start..` of one layer, `[token][kv_head][head_dim]` each.
    fn write(&mut self, layer: usize, start: usize, k: &[f32], v: &[f32]) {
        let (hd, row, bf, dtype, layers) = (self.head_dim, self.kv_heads * self.head_dim, self.block_floats(), self.dtype, self.layers);
        let tokens = k.len() / row;
        let needed = (start + tokens).div_ceil(BLOCK);
        while self.blocks.len() < needed {
            let zeroed = || (0..layers).map(|_| KvBlock::zeroed(dtype, bf)).collect();
            self.blocks.push(Arc::new(HostBlock { keys: zeroed(), values: zeroed() }));
        }
        let mut t = 0;
        while t < tokens {
            let b = (start + t) / BLOCK;
            // A block another sequence holds too is copied before the first write (copy on write).
            let block = Arc::make_mut(&mut self.blocks[b]);
            let (kb, vb) = (&mut block.keys[layer], &mut block.values[layer]);
            while t < tokens && (start + t) / BLOCK == b {
                let c = (start + t) % BLOCK;
                for h in 0..self.kv_heads {
                    let src = t * row + h * hd;
                    kb.store(h * hd * BLOCK + c, BLOCK, &k[src..src + hd]);
                    vb.store((h * BLOCK + c) * hd, 1, &v[src..src + hd]);
                }
                t += 1;
            }
        }
    }
}

/// A step on the host backend: every new token's position, in step order.
pub struct HostStep {
    positions: Vec<usize>,
}

impl HostAttention {
    /// The host backend for a model on the CPU in f32 (the only dtype its kernels compute in), its cache holding
    /// keys and values in `kv_dtype` (f32, f16 or bf16).
    pub fn new(model: &impl AttentionModel, kv_dtype: DType) -> candle_core::Result<HostAttention> {
        if !model.device().is_cpu() || model.dtype() != DType::F32 {
            candle_core::bail!("the host attention backend runs f32 models on the CPU; this one is {:?} on {:?}", model.dtype(), model.device().location());
        }
        if !matches!(kv_dtype, DType::F32 | DType::F16 | DType::BF16) {
            candle_core::bail!("the host attention backend holds keys and values in f32, f16 or bf16, not {kv_dtype:?}");
        }
        Ok(HostAttention::for_shape(model.attention_shape().clone(), kv_dtype))
    }

    /// The backend for a shape alone (no weights): what `bench kernels` measures attention with.
    pub fn for_shape(shape: AttentionShape, kv_dtype: DType) -> HostAttention {
        let rope = shape.rope_sets();
        let block_bytes = shape.kv_block_bytes(kv_dtype);
        HostAttention { out_width: shape.out_width, shape, rope, kv_dtype, block_bytes, device: Device::Cpu, tiles: false }
    }

    /// The same backend with its prefills on the tile unit where it runs ([`super::amx`], [`tiles_available`]:
    /// asked once, here), or not.
    pub fn with_tiles(self, tiles: bool) -> HostAttention {
        HostAttention { tiles: tiles && tiles_available(self.shape.head_dim), ..self }
    }

    /// One decode step's attention over every layer for sequences already holding `caches` (one new token each,
    /// queries `q` `[caches, heads x head_dim]`), which it reads and leaves as they were: `bench kernels`'
    /// measurement of the part of a step that streams the KV cache.
    pub fn decode_attention(&self, level: Level, caches: &mut [HostCache], q: &[f32]) -> Vec<f32> {
        const ONE: [u32; 1] = [0];
        let segments: Vec<Segment<'_, HostCache>> = caches.iter_mut().map(|cache| Segment { tokens: &ONE, cache }).collect();
        let mut out = Vec::new();
        for layer in 0..self.shape.layers {
            out = self.attention(level, layer, q, &segments);
        }
        out
    }

    /// The attention of a prefill of `new` tokens (queries `q` `[new, heads x head_dim]`) over every layer of a
    /// cache that holds their keys and values past its length ([`HostAttention::prefilled_cache`]), which it reads
    /// and leaves as it was: `bench kernels`' measurement of a prefill's attention over a cached prefix.
    pub fn prefill_attention(&self, level: Level, cache: &mut HostCache, q: &[f32], new: usize) -> Vec<f32> {
        let tokens = vec![0u32; new];
        let segments = [Segment { tokens: &tokens, cache }];
        let mut out = Vec::new();
        for layer in 0..self.shape.layers {
            out = self.attention(level, layer, q, &segments);
        }
        out
    }

    /// A cache of `cached + new` positions of the given keys and values (`[cached + new][kv_heads x head_dim]`,
    /// every layer the same) whose length is `cached`: the last `new` positions are a prefill's own.
    pub fn prefilled_cache(&self, k: &[f32], v: &[f32], cached: usize, new: usize) -> HostCache {
        let mut cache = self.filled_cache(k, v, cached + new);
        cache.len = cached;
        cache
    }

    /// A cache of `len` positions of the given keys and values (`[len][kv_heads x head_dim]`, every layer the
    /// same) but the last, whose keys and values are written and which attention then sees as the new token's.
    pub fn filled_cache(&self, k: &[f32], v: &[f32], len: usize) -> HostCache {
        let mut cache = self.new_cache(len);
        for layer in 0..self.shape.layers {
            cache.write(layer, 0, k, v);
        }
        cache.len = len - 1;
        cache
    }

    /// A cache holding exactly `len` positions of the given keys and values: a prefix for
    /// [`HostAttention::extended_cache`].
    pub fn prefix_cache(&self, k: &[f32], v: &[f32], len: usize) -> HostCache {
        let mut cache = self.new_cache(len);
        for layer in 0..self.shape.layers {
            cache.write(layer, 0, k, v);
        }
        cache.len = len;
        cache
    }

    /// [`HostAttention::filled_cache`]'s cache of `len` positions whose first `prefix.len()` are `prefix`'s blocks,
    /// shared with it (as a prefix cache hit holds them; a partly filled last block is copied): `k` and `v` hold
    /// every position's keys and values, of which those past the prefix are written.
    pub fn extended_cache(&self, prefix: &HostCache, k: &[f32], v: &[f32], len: usize) -> HostCache {
        let (row, from) = (self.shape.kv_heads * self.shape.head_dim, prefix.len);
        let mut cache = prefix.clone();
        for layer in 0..self.shape.layers {
            cache.write(layer, from, &k[from * row..len * row], &v[from * row..len * row]);
        }
        cache.len = len - 1;
        cache
    }

    /// Rotary embedding of one token's heads, pairs of adjacent values (GGUF llama weights are permuted for it, and
    /// Hugging Face ones at load, see [`super::hf`]).
    fn rope(&self, heads: &mut [f32], pos: usize, set: usize) {
        let half = self.shape.head_dim / 2;
        let (cos, sin) = &self.rope[set];
        let cos = &cos[pos * half..(pos + 1) * half];
        let sin = &sin[pos * half..(pos + 1) * half];
        for head in heads.chunks_exact_mut(self.shape.head_dim) {
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
    ///
    /// Decodes whose caches hold the same leading blocks (a prefix cache hit, the choices of a row) share a task
    /// instead, up to [`CASCADE`] of them: the shared blocks are read once for all their rows, then each sequence's
    /// own ([`HostAttention::tasks`]), where a step would read the shared prefix once per sequence (from the CPU's
    /// caches while they hold it: on a 2-core Xeon, the 1B's decode step over 640 shared positions of 800 took 10-20
    /// % less). Each row's arithmetic is the same either way (the same chunks in the same order), so the same bits.
    fn attention(&self, level: Level, layer: usize, q: &[f32], segments: &[Segment<'_, HostCache>]) -> Vec<f32> {
        let cfg = &self.shape;
        let (hd, group) = (cfg.head_dim, cfg.heads / cfg.kv_heads);
        let tasks = self.tasks(layer, q, segments, if self.tiles { AMX_TILE } else { TILE });
        let results: Vec<Vec<f32>> = tasks.par_iter().map(|task| self.attend_tile(level, task)).collect();
        // Rows as wide as the laid-out attention output, the padding zero.
        let row = self.out_width;
        let tokens: usize = segments.iter().map(|s| s.tokens.len()).sum();
        let mut attn = vec![0f32; tokens * row];
        for (task, out) in tasks.iter().zip(results) {
            // `out` is, part after part, [token][group][head_dim]; query head `kv * group + g` uses kv head `kv`.
            let mut rows = out.chunks_exact(group * hd);
            for part in &task.parts {
                for (token, chunk) in (part.t0..part.t1).zip(rows.by_ref()) {
                    attn[(part.start + token) * row + task.kv * group * hd..][..group * hd].copy_from_slice(chunk);
                }
            }
        }
        attn
    }

    /// The step's attention tasks: per kv head, a tile of up to [`TILE`] new tokens of a segment, or up to
    /// [`CASCADE`] decodes whose caches share their leading blocks. Decodes are grouped by their cache's first
    /// block, in step order, and a group split so that there are at least four tasks per thread where it can be;
    /// the blocks a task's sequences share are its whole chunks that all of them hold at the same address (so the
    /// same keys and values) and every row sees in full. Not in a sliding-window layer (rows see different
    /// windows), nor for a cache that let blocks go.
    fn tasks<'a, 'b>(&self, layer: usize, q: &'a [f32], segments: &'a [Segment<'b, HostCache>], tile: usize) -> Vec<Task<'a, 'b>> {
        let kv_heads = self.shape.kv_heads;
        let mut starts = Vec::with_capacity(segments.len());
        let mut offset = 0;
        for s in segments {
            starts.push(offset);
            offset += s.tokens.len();
        }
        let part = |si: usize, t0: usize, t1: usize| Part { segment: &segments[si], start: starts[si], t0, t1 };
        let mut tasks = Vec::new();
        let alone = |tasks: &mut Vec<Task<'a, 'b>>, si: usize| {
            let new = segments[si].tokens.len();
            for t0 in (0..new).step_by(tile) {
                tasks.extend((0..kv_heads).map(|kv| Task { layer, q, kv, parts: vec![part(si, t0, (t0 + tile).min(new))], shared: 0 }));
            }
        };
        // Decodes that may share blocks, by the address of their first block, in step order.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut by_first: std::collections::HashMap<*const HostBlock, usize> = std::collections::HashMap::new();
        let windowed = self.shape.window(layer).is_some();
        for (si, s) in segments.iter().enumerate() {
            let c = &s.cache;
            if windowed || s.tokens.len() != 1 || c.released > 0 || c.len < CHUNK {
                alone(&mut tasks, si);
                continue;
            }
            let g = *by_first.entry(Arc::as_ptr(&c.blocks[0])).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push(si);
        }
        let wanted = 4 * rayon::current_num_threads();
        for members in groups {
            let size = (members.len() * kv_heads / wanted).clamp(2, CASCADE);
            for sub in members.chunks(size) {
                let caches: Vec<&HostCache> = sub.iter().map(|&si| &*segments[si].cache).collect();
                // Whole blocks every member's rows see (positions below its length) and all hold at one address.
                let limit = caches.iter().map(|c| c.len / BLOCK).min().unwrap_or(0);
                let common = (0..limit).take_while(|&b| caches[1..].iter().all(|c| Arc::ptr_eq(&c.blocks[b], &caches[0].blocks[b]))).count();
                let shared = common - common % CHUNK_BLOCKS;
                if sub.len() < 2 || shared == 0 {
                    sub.iter().for_each(|&si| alone(&mut tasks, si));
                    continue;
                }
                tasks.extend((0..kv_heads).map(|kv| Task { layer, q, kv, parts: sub.iter().map(|&si| part(si, 0, 1)).collect(), shared }));
            }
        }
        tasks
    }

    /// A task's attention, every query head of its kv head: part after part, `[token][group][head_dim]`. The same
    /// source ([`tile`]) compiled for AVX-512 (at the VNNI and AMX levels, where the CPU has it), for AVX2 and FMA,
    /// or for any CPU (the release build targets plain x86-64): the same operations in the same order, so the same
    /// bits, 16, 8 or 1 wide.
    fn attend_tile(&self, level: Level, task: &Task<'_, '_>) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        {
            if self.tiles && task.shared == 0 && task.parts.iter().all(|p| p.t1 - p.t0 > 1) {
                // SAFETY: `self.tiles` is set only where `tiles_available` said the tile unit's bf16 products run
                // here (AMX-BF16 granted, AVX-512 F and BW: `with_tiles`), and the CPU has AVX2, FMA and F16C (every
                // CPU with AMX has them).
                return unsafe { self.attend_tile_amx(task) };
            }
            if level >= Level::Vnni && is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (detected just now) and, at this level (callers pass the active one or
                // one of `Level::available`, never above the detected one), AVX2, FMA and F16C.
                return unsafe { self.attend_tile_avx512(task) };
            }
            if level >= Level::Avx2 {
                // SAFETY: the level is at most the detected one, so the CPU has AVX2, FMA and F16C.
                return unsafe { self.attend_tile_avx2(task) };
            }
            if is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has FMA (detected just now).
                return unsafe { self.attend_tile_fma(task) };
            }
        }
        // Without the FMA instruction (x86-64 CPUs before 2013, or a virtual CPU that hides it), each `mul_add` is
        // a call into libm's exact `fmaf`: the same bits, 20 to 60 times slower than the AVX2 level.
        self.attend_tile_body::<4, 1, 8, 8>(task)
    }

    /// The portable level where the CPU has the FMA instruction but not the AVX2 level (AMD's 2012-2015 cores, or
    /// a level forced lower): the portable arithmetic, its fused multiply-adds one instruction each.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "fma")]
    fn attend_tile_fma(&self, task: &Task<'_, '_>) -> Vec<f32> {
        self.attend_tile_body::<4, 1, 8, 8>(task)
    }

    /// Scores 6 rows at a time (12 registers of sums), values 2 rows x 32 dimensions (8 registers), a lone row (a
    /// decode's odd query head) 64 dimensions at a time (8 chains of multiply-adds, where 32 gave 4). On a 2-core
    /// AMD EPYC (Zen 3), one thread, alternating with 4 rows' scores sample by sample: prefills' attention 4-11 % faster.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn attend_tile_avx2(&self, task: &Task<'_, '_>) -> Vec<f32> {
        self.attend_tile_body::<6, 2, 32, 64>(task)
    }

    /// Scores 8 rows at a time (a register of 16 positions each), values 4 rows x 64 dimensions (16 registers).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    fn attend_tile_avx512(&self, task: &Task<'_, '_>) -> Vec<f32> {
        self.attend_tile_body::<8, 4, 64, 128>(task)
    }

    /// The task's attention, chunk by chunk ([`tile`]): `SR` rows' scores at a time, `VR` rows x `W` dimensions of
    /// output at a time, a row left over `W1` dimensions at a time (register blocking only: every choice gives the
    /// same bits; with `VR` 1 no row is left over). The blocks its parts share first, for every row at once, then
    /// each part's own.
    #[inline(always)]
    fn attend_tile_body<const SR: usize, const VR: usize, const W: usize, const W1: usize>(&self, task: &Task<'_, '_>) -> Vec<f32> {
        let (mut state, spans) = Rows::new(&self.shape, task);
        // The blocks every part shares, once for all the task's rows; then each part's own.
        if task.shared > 0 {
            let rows = 0..state.queries.len();
            state.attend::<SR, VR, W, W1>(rows, spans[0].1, 0, task.shared, true);
        }
        for (part, blocks, decoding) in spans {
            // Blocks before every row's window are not read, nor those read above for every part.
            let (from, to) = ((state.first[part.start] / BLOCK).max(task.shared), state.visible[part.end - 1].div_ceil(BLOCK));
            state.attend::<SR, VR, W, W1>(part, blocks, from, to, decoding);
        }
        state.finish()
    }

    /// A prefill task's attention on the tile unit ([`super::amx`]): the same rows, chunks and softmax steps as
    /// [`HostAttention::attend_tile_body`], the scores and weighted values as split bf16 products.
    ///
    /// Safety: [`tiles_available`] said yes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn attend_tile_amx(&self, task: &Task<'_, '_>) -> Vec<f32> {
        let (mut state, spans) = Rows::new(&self.shape, task);
        for (part, blocks, _) in spans {
            let (from, to) = (state.first[part.start] / BLOCK, state.visible[part.end - 1].div_ceil(BLOCK));
            // SAFETY: the caller's contract.
            unsafe { state.attend_tiles(part, blocks, from, to) };
        }
        state.finish()
    }
}

/// Whether the host attention's prefills can run on the tile unit here ([`super::amx`], `runtime.attention =
/// "host-amx"`): the CPU has AMX-BF16, Linux granted the tiles, and heads are a multiple of 64 wide.
pub fn tiles_available(head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::amx::available(head_dim);
    #[allow(unreachable_code)]
    {
        let _ = head_dim;
        false
    }
}

/// A part's rows in its task, its cache's blocks, and whether it decodes.
type Span<'a> = (std::ops::Range<usize>, &'a [Arc<HostBlock>], bool);

/// A task's rows as [`HostAttention::attend_tile_body`] computes them: per row where its query starts in `q`, the
/// positions it sees (below `visible`; in a sliding-window layer, from `first` on) and its online softmax's state
/// and output; per chunk its scores, then weights, and the positions it sees; a 16-bit cache's blocks widened (one
/// of keys at a time, the chunk's values).
struct Rows<'t> {
    q: &'t [f32],
    layer: usize,
    kv: usize,
    hd: usize,
    scoring: tile::Scoring,
    queries: Vec<usize>,
    visible: Vec<usize>,
    first: Vec<usize>,
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
    weights: Vec<f32>,
    ranges: Vec<(usize, usize)>,
    /// The rows' queries transposed per group of rows scored together ([`tile::transpose`]), row `r`'s group from
    /// `r x head_dim`: set per [`Rows::attend`].
    qt: Vec<f32>,
    k_scratch: Vec<f32>,
    v_scratch: Vec<Vec<f32>>,
}

impl<'t> Rows<'t> {
    /// The task's rows, part after part (in a part, token `t0 + i / group`, query head `kv * group + i % group`),
    /// and per part its rows, its cache's blocks and whether it decodes.
    fn new<'a>(cfg: &AttentionShape, task: &'a Task<'t, '_>) -> (Rows<'t>, Vec<Span<'a>>) {
        let (hd, group) = (cfg.head_dim, cfg.heads / cfg.kv_heads);
        let (q_row, window) = (cfg.heads * hd, cfg.window(task.layer));
        let (mut queries, mut visible, mut first, mut spans) = (Vec::new(), Vec::new(), Vec::new(), Vec::with_capacity(task.parts.len()));
        for p in &task.parts {
            let (new, from) = (p.segment.tokens.len(), queries.len());
            let total = p.segment.cache.len + new;
            for i in 0..(p.t1 - p.t0) * group {
                let token = p.t0 + i / group;
                queries.push((p.start + token) * q_row + (task.kv * group + i % group) * hd);
                let seen = total - new + token + 1;
                visible.push(seen);
                first.push(window.map_or(0, |w| seen.saturating_sub(w)));
            }
            spans.push((from..queries.len(), &p.segment.cache.blocks[..], p.t1 - p.t0 == 1));
        }
        let rows = queries.len();
        let sixteen = task.parts[0].segment.cache.dtype != DType::F32;
        let scratch = |_| if sixteen { vec![0f32; hd * BLOCK] } else { Vec::new() };
        let state = Rows {
            q: task.q,
            layer: task.layer,
            kv: task.kv,
            hd,
            scoring: tile::Scoring { scale: cfg.scale, softcap: cfg.softcap },
            queries,
            visible,
            first,
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0f32; rows],
            out: vec![0f32; rows * hd],
            weights: vec![0f32; rows * CHUNK],
            ranges: vec![(0, 0); rows],
            qt: vec![0f32; rows * hd],
            k_scratch: scratch(0),
            v_scratch: (0..CHUNK_BLOCKS).map(scratch).collect(),
        };
        (state, spans)
    }

    /// Every row's output divided by its softmax's sum: the task's result.
    fn finish(self) -> Vec<f32> {
        let mut out = self.out;
        for (o, s) in out.chunks_exact_mut(self.hd).zip(&self.sum) {
            let inv = 1.0 / s;
            for x in o {
                *x *= inv;
            }
        }
        out
    }

    /// [`Rows::attend`] on the tile unit ([`super::amx`]), for prefill rows: per chunk, the keys laid out as tiles,
    /// each 16 rows' scores, every row's softmax step (as at every level), its weights split into bf16 parts, the
    /// values laid out, and each 16 rows' weighted values added into their outputs. Rows are padded to a multiple of
    /// 16 with zero queries and zero weights.
    ///
    /// Safety: [`tiles_available`] said yes; the CPU has AVX-512 F and BW.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn attend_tiles(&mut self, rows: std::ops::Range<usize>, blocks: &[Arc<HostBlock>], from: usize, to: usize) {
        use super::amx::{self, ROWS as T, TILE as AT};
        use crate::engine::kernels::split_bf16_parts;
        let (layer, kv, hd) = (self.layer, self.kv, self.hd);
        let (n, padded) = (rows.len(), rows.len().next_multiple_of(T));
        let (mut qhi, mut qlo) = (vec![0u16; padded * hd], vec![0u16; padded * hd]);
        for (i, r) in rows.clone().enumerate() {
            let query = &self.q[self.queries[r]..][..hd];
            // SAFETY: the CPU has AVX-512 F and BW (the caller's contract).
            unsafe { split_bf16_parts(query, &mut qhi[i * hd..(i + 1) * hd], &mut qlo[i * hd..(i + 1) * hd]) };
        }
        let mut scores = vec![0f32; padded * CHUNK];
        let (mut whi, mut wlo) = (vec![0u16; padded * CHUNK], vec![0u16; padded * CHUNK]);
        let (per_block, per_half) = (2 * hd / 32 * AT, 2 * hd / T * AT);
        let (mut keys, mut values) = (vec![0u16; CHUNK_BLOCKS * per_block], vec![0u16; 2 * per_half]);
        let mut partial = vec![0f32; T * hd];
        // SAFETY: the caller's contract (`tiles_available`).
        unsafe { amx::configure() };
        for c0 in (from - from % CHUNK_BLOCKS..to).step_by(CHUNK_BLOCKS) {
            let (lo, hi) = (from.max(c0), to.min(c0 + CHUNK_BLOCKS));
            for (s, laid) in keys.chunks_exact_mut(per_block).enumerate() {
                if (lo..hi).contains(&(c0 + s)) {
                    let k = blocks[c0 + s].keys[layer].read(kv * hd * BLOCK, hd * BLOCK, &mut self.k_scratch);
                    // SAFETY: the CPU has AVX-512 F and BW (the caller's contract).
                    unsafe { amx::lay_keys(k, hd, laid) };
                } else {
                    laid.fill(0);
                }
            }
            for t in 0..padded / T {
                let q = [&qhi[t * T * hd..(t + 1) * T * hd], &qlo[t * T * hd..(t + 1) * T * hd]];
                // SAFETY: configured above.
                unsafe { amx::scores(q, &keys, hd, &mut scores[t * T * CHUNK..(t + 1) * T * CHUNK]) };
            }
            let base = c0 * BLOCK;
            for r in rows.clone() {
                self.ranges[r] = (self.first[r].saturating_sub(base).min(CHUNK), self.visible[r].saturating_sub(base).min(CHUNK));
            }
            for t0 in (0..n).step_by(T) {
                let (t1, r0) = ((t0 + T).min(n), rows.start + t0);
                let r1 = rows.start + t1;
                let tile_scores = &mut scores[t0 * CHUNK..(t0 + T) * CHUNK];
                match self.scoring.softcap {
                    // SAFETY: the CPU has AVX-512 F and BW, AVX2 and FMA (the caller's contract).
                    None => unsafe { amx::softmax_rows(tile_scores, &self.ranges[r0..r1], self.scoring.scale, &mut self.max[r0..r1], &mut self.sum[r0..r1], &mut self.out[r0 * hd..r1 * hd], hd) },
                    // Soft-capped scores (Gemma 2) row by row, as at every level.
                    Some(_) => {
                        for (i, r) in (r0..r1).enumerate() {
                            let row: &mut [f32; CHUNK] = (&mut tile_scores[i * CHUNK..(i + 1) * CHUNK]).try_into().expect("a chunk of scores");
                            let range = self.ranges[r];
                            tile::softmax_step(row, range.0, range.1, self.scoring, &mut self.max[r], &mut self.sum[r], &mut self.out[r * hd..(r + 1) * hd]);
                        }
                    }
                }
            }
            for i in 0..n {
                // SAFETY: the CPU has AVX-512 F and BW (the caller's contract).
                unsafe { split_bf16_parts(&scores[i * CHUNK..(i + 1) * CHUNK], &mut whi[i * CHUNK..(i + 1) * CHUNK], &mut wlo[i * CHUNK..(i + 1) * CHUNK]) };
            }
            let mut read: [&[f32]; CHUNK_BLOCKS] = [&[]; CHUNK_BLOCKS];
            for (b, vs) in (lo..hi).zip(self.v_scratch.iter_mut()) {
                read[b - c0] = blocks[b].values[layer].read(kv * BLOCK * hd, BLOCK * hd, vs);
            }
            for (h, laid) in values.chunks_exact_mut(per_half).enumerate() {
                // SAFETY: the CPU has AVX-512 F and BW (the caller's contract).
                unsafe { amx::lay_values([read[2 * h], read[2 * h + 1]], hd, laid) };
            }
            for t in 0..padded / T {
                let w = [&whi[t * T * CHUNK..(t + 1) * T * CHUNK], &wlo[t * T * CHUNK..(t + 1) * T * CHUNK]];
                let (first, real) = (rows.start + t * T, (n - t * T).min(T));
                if real == T {
                    // SAFETY: configured above.
                    unsafe { amx::weighted(w, &values, hd, &mut self.out[first * hd..(first + T) * hd]) };
                } else {
                    partial.fill(0.0);
                    // SAFETY: configured above.
                    unsafe { amx::weighted(w, &values, hd, &mut partial) };
                    for (o, p) in self.out[first * hd..(first + real) * hd].iter_mut().zip(&partial) {
                        *o += p;
                    }
                }
            }
        }
        // SAFETY: configured above.
        unsafe { amx::release() };
    }

    /// Rows `rows` over blocks `from..to` of `blocks` (the chunks holding them; the blocks outside not read).
    #[inline(always)]
    fn attend<const SR: usize, const VR: usize, const W: usize, const W1: usize>(&mut self, rows: std::ops::Range<usize>, blocks: &[Arc<HostBlock>], from: usize, to: usize, decoding: bool) {
        let (layer, kv, hd, q) = (self.layer, self.kv, self.hd, self.q);
        // The rows scored together: `SR` at a time, then 4, 3, 2 or 1; their queries transposed once here.
        let group = |left: usize| match left {
            n if n >= SR => SR,
            n if n >= 4 => 4,
            n => n,
        };
        let mut r = rows.start;
        while r < rows.end {
            let n = group(rows.end - r);
            tile::transpose(q, &self.queries[r..r + n], hd, &mut self.qt[r * hd..(r + n) * hd]);
            r += n;
        }
        for c0 in (from - from % CHUNK_BLOCKS..to).step_by(CHUNK_BLOCKS) {
            let (lo, hi) = (from.max(c0), to.min(c0 + CHUNK_BLOCKS));
            for b in lo..hi {
                // Decoding, block b's values and the next block's keys are asked for a line at a time as block b's
                // scores are computed (with the first rows; a 16-bit cache's lines first, as they are half as many):
                // a sequence's blocks are separate allocations, so the CPU's own stream prefetchers start over at
                // each one, and a decode step otherwise waits on the first loads of each (`bench kernels`, 16
                // sequences of 1,024 positions: 1.3 to 1.5 times the bytes per second). A prefill's tiles read
                // blocks the step has just written or other tiles read, from the L2 cache, where asking cost more
                // than it gained.
                let ahead = match blocks.get(b + 1).filter(|_| decoding && b + 1 < to) {
                    Some(next) => [Ahead::new(next.keys[layer].bytes(kv * hd * BLOCK, hd * BLOCK)), Ahead::new(blocks[b].values[layer].bytes(kv * BLOCK * hd, BLOCK * hd))],
                    None => [Ahead::NONE; 2],
                };
                let keys = blocks[b].keys[layer].read(kv * hd * BLOCK, hd * BLOCK, &mut self.k_scratch);
                let mut r = rows.start;
                while r < rows.end {
                    let n = group(rows.end - r);
                    let (at, qt) = (&mut self.weights[r * CHUNK..], &self.qt[r * hd..(r + n) * hd]);
                    let (slot, ahead) = (b - c0, if r == rows.start { ahead } else { [Ahead::NONE; 2] });
                    match n {
                        n if n == SR => tile::scores::<SR>(at, qt.as_chunks().0, keys, slot, ahead),
                        4 => tile::scores::<4>(at, qt.as_chunks().0, keys, slot, ahead),
                        3 => tile::scores::<3>(at, qt.as_chunks().0, keys, slot, ahead),
                        2 => tile::scores::<2>(at, qt.as_chunks().0, keys, slot, ahead),
                        _ => tile::scores::<1>(at, qt.as_chunks().0, keys, slot, ahead),
                    }
                    r += n;
                }
            }
            let base = c0 * BLOCK;
            for r in rows.clone() {
                self.ranges[r] = (self.first[r].saturating_sub(base).min(CHUNK), self.visible[r].saturating_sub(base).min(CHUNK));
            }
            let (w, o) = (&mut self.weights[rows.start * CHUNK..rows.end * CHUNK], &mut self.out[rows.start * hd..rows.end * hd]);
            tile::softmax_rows(w, &self.ranges[rows.clone()], self.scoring, &mut self.max[rows.clone()], &mut self.sum[rows.clone()], o, hd);
            let mut values: [&[f32]; CHUNK_BLOCKS] = [&[]; CHUNK_BLOCKS];
            for (b, vs) in (lo..hi).zip(self.v_scratch.iter_mut()) {
                values[b - c0] = blocks[b].values[layer].read(kv * BLOCK * hd, BLOCK * hd, vs);
            }
            let (o, w) = (&mut self.out[rows.start * hd..rows.end * hd], &self.weights[rows.start * CHUNK..rows.end * CHUNK]);
            tile::accumulate_rows::<VR, W, W1>(o, w, &values, &self.ranges[rows.clone()], hd);
        }
    }
}

impl Attention for HostAttention {
    type Cache = HostCache;
    type Step = HostStep;
    type Block = Arc<HostBlock>;

    fn new_cache(&self, capacity_tokens: usize) -> HostCache {
        let cfg = &self.shape;
        let blocks = Vec::with_capacity(capacity_tokens.div_ceil(BLOCK));
        HostCache { blocks, released: 0, dtype: self.kv_dtype, layers: cfg.layers, kv_heads: cfg.kv_heads, head_dim: cfg.head_dim, len: 0 }
    }

    /// The same blocks, shared: the first of the two to write into a shared block copies it.
    fn fork(&self, cache: &HostCache) -> candle_core::Result<HostCache> {
        Ok(cache.clone())
    }

    fn share_block(&self, cache: &HostCache, index: usize) -> Option<Arc<HostBlock>> {
        cache.blocks.get(index).filter(|_| index >= cache.released).cloned()
    }

    fn cache_from_blocks(&self, blocks: Vec<Arc<HostBlock>>, capacity_tokens: usize) -> HostCache {
        let mut cache = self.new_cache(capacity_tokens.max(blocks.len() * BLOCK));
        cache.len = blocks.len() * BLOCK;
        cache.blocks.extend(blocks);
        cache
    }

    fn release_before(&self, cache: &mut HostCache, blocks: usize) {
        let end = blocks.min(cache.blocks.len());
        if end > cache.released {
            let gone = HostCache::released_block();
            cache.blocks[cache.released..end].fill(gone);
            cache.released = end;
        }
    }

    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Blocks are allocated as they are first written, so a step needs no room made in advance.
    fn begin(&self, _segments: &mut [Segment<'_, HostCache>], positions: &[usize]) -> candle_core::Result<HostStep> {
        Ok(HostStep { positions: positions.to_vec() })
    }

    fn attend(&self, step: &HostStep, layer: usize, qkv: [Tensor; 3], segments: &mut [Segment<'_, HostCache>]) -> candle_core::Result<Tensor> {
        let [q, k, v] = qkv;
        let qkv = [q.flatten_all()?.to_vec1::<f32>()?, k.flatten_all()?.to_vec1::<f32>()?, v.flatten_all()?.to_vec1::<f32>()?];
        let attn = self.attend_host(step, layer, qkv, segments)?;
        Tensor::from_vec(attn, (step.positions.len(), self.out_width), &self.device)
    }

    fn host_vectors(&self) -> bool {
        true
    }

    fn attend_host(&self, step: &HostStep, layer: usize, qkv: [Vec<f32>; 3], segments: &mut [Segment<'_, HostCache>]) -> candle_core::Result<Vec<f32>> {
        let cfg = &self.shape;
        let (hd, kv_row) = (cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let [mut q, mut k, v] = qkv;
        let tokens = step.positions.len();
        if q.len() != tokens * cfg.heads * hd || k.len() != tokens * kv_row || v.len() != tokens * kv_row {
            candle_core::bail!("attention inputs of {}, {} and {} values for {tokens} tokens", q.len(), k.len(), v.len());
        }
        let set = cfg.rope_set(layer);
        for (t, &pos) in step.positions.iter().enumerate() {
            self.rope(&mut q[t * cfg.heads * hd..(t + 1) * cfg.heads * hd], pos, set);
            self.rope(&mut k[t * kv_row..(t + 1) * kv_row], pos, set);
        }
        let mut offset = 0;
        for s in segments.iter_mut() {
            let (len, start) = (s.tokens.len(), s.cache.len);
            s.cache.write(layer, start, &k[offset * kv_row..(offset + len) * kv_row], &v[offset * kv_row..(offset + len) * kv_row]);
            offset += len;
        }
        Ok(self.attention(Level::active(), layer, &q, segments))
    }

    fn advance(&self, segments: &mut [Segment<'_, HostCache>]) {
        for s in segments.iter_mut() {
            s.cache.len += s.tokens.len();
        }
    }

    fn device_argmax(&self) -> bool {
        false
    }
}

/// One attention task: kv head `kv` of layer `layer` (every query head that uses it) for the new tokens of one or
/// more parts, queries in `q`, whose caches hold their first `shared` blocks (a multiple of [`CHUNK_BLOCKS`], every
/// row seeing all their positions) at the same addresses: 0 for a single part.
struct Task<'a, 'b> {
    layer: usize,
    q: &'a [f32],
    kv: usize,
    parts: Vec<Part<'a, 'b>>,
    shared: usize,
}

/// New tokens `t0..t1` of a segment whose first new token is row `start` of the step's queries.
struct Part<'a, 'b> {
    segment: &'a Segment<'b, HostCache>,
    start: usize,
    t0: usize,
    t1: usize,
}

/// New tokens per attention task: each kv block read serves this many tokens times the query group.
const TILE: usize = 8;

/// Decodes per task at most that share their leading blocks: as many rows as a tile of a prefill.
const CASCADE: usize = TILE;

/// New tokens per attention task on the tile unit ([`super::amx`]): laying a block out as tiles costs about as
/// much as [`TILE`] tokens' f32 arithmetic over it (an estimate), so each block laid out serves more rows.
const AMX_TILE: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AttentionShape {
        AttentionShape {
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            context_length: 512,
            out_width: 32,
            rope_frequencies: (0..4).map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / 8.0)).collect(),
            scale: AttentionShape::default_scale(8),
            softcap: None,
            sliding: None,
        }
    }

    fn noise(n: usize, salt: u64) -> Vec<f32> {
        let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Gemma's attention: a scale of its own, soft-capped scores, and layer 1 sliding over `window` positions.
    fn gemma(window: usize) -> AttentionShape {
        AttentionShape {
            scale: 0.6,
            softcap: Some(1.5),
            sliding: Some(super::super::SlidingWindow { window, layers: vec![false, true], rope_frequencies: None }),
            ..config()
        }
    }

    /// Layer 1's attention output for one query head `q` over positions `seen` of keys and values `[position][kv
    /// head][head_dim]` (each value as the cache holds it: `held`), by a direct softmax in f64.
    fn direct_attention(cfg: &AttentionShape, q: &[f32], k: &[f32], v: &[f32], kv_head: usize, seen: std::ops::Range<usize>, held: impl Fn(f32) -> f32) -> Vec<f64> {
        let (hd, kv_row) = (cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let at = |x: &[f32], j: usize, d: usize| held(x[j * kv_row + kv_head * hd + d]) as f64;
        let scores: Vec<f64> = seen
            .clone()
            .map(|j| {
                let score = (0..hd).map(|d| q[d] as f64 * at(k, j, d)).sum::<f64>() * cfg.scale as f64;
                cfg.softcap.map_or(score, |cap| cap as f64 * (score / cap as f64).tanh())
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        (0..hd).map(|d| seen.clone().zip(&weights).map(|(j, w)| w * at(v, j, d)).sum::<f64>() / total).collect()
    }

    /// Asserts every row of a prefill's attention `out` (`new` tokens after `cached` positions, queries `q`) within
    /// 1e-5 of [`direct_attention`] over its causal range (its window's); the largest difference.
    #[allow(clippy::too_many_arguments)]
    fn within_of_direct_attention(cfg: &AttentionShape, out: &[f32], q: &[f32], k: &[f32], v: &[f32], cached: usize, held: impl Fn(f32) -> f32 + Copy, what: &str) -> f64 {
        let (hd, group, q_row) = (cfg.head_dim, cfg.heads / cfg.kv_heads, cfg.heads * cfg.head_dim);
        let (window, new) = (cfg.window(1).unwrap_or(usize::MAX), q.len() / q_row);
        assert_eq!(out.len(), new * q_row, "{what}");
        let mut worst = 0f64;
        for t in 0..new {
            let seen = cached + t + 1;
            for h in 0..cfg.heads {
                let expected = direct_attention(cfg, &q[t * q_row + h * hd..][..hd], k, v, h / group, seen.saturating_sub(window)..seen, held);
                for (d, expected) in expected.into_iter().enumerate() {
                    let got = out[t * q_row + h * hd + d] as f64;
                    worst = worst.max((got - expected).abs());
                    assert!((got - expected).abs() < 1e-5, "{what}, token {t}, head {h}, dim {d}: {got} against {expected}");
                }
            }
        }
        worst
    }

    /// A decode step's attention, whose blocks are read with the next one hinted into the cache, against a direct
    /// softmax in f64 over every position: one block or part of one, block edges, many blocks; f32 and f16 caches
    /// (the reference sees the keys and values as the cache holds them); and Gemma's attention, a scale of its own,
    /// soft-capped scores and a sliding window of 37 positions (several blocks) or of 5 (less than a block).
    #[test]
    fn decode_attention_matches_a_direct_softmax_over_every_block() {
        for (cfg, dtype) in [(config(), DType::F32), (config(), DType::F16), (gemma(37), DType::F32), (gemma(5), DType::F16)] {
            let (hd, group, kv_row, q_row) = (cfg.head_dim, cfg.heads / cfg.kv_heads, cfg.kv_heads * cfg.head_dim, cfg.heads * cfg.head_dim);
            let window = cfg.window(1).unwrap_or(usize::MAX);
            let host = HostAttention::for_shape(cfg.clone(), dtype).with_tiles(true);
            let held = |x: f32| if dtype == DType::F16 { half::f16::from_f32(x).to_f32() } else { x };
            for len in [1, 15, 16, 17, 100, 300] {
                let kv: Vec<(Vec<f32>, Vec<f32>)> = (0..3).map(|s| (noise(len * kv_row, 10 * s + len as u64), noise(len * kv_row, 10 * s + 5 + len as u64))).collect();
                let mut caches: Vec<HostCache> = kv.iter().map(|(k, v)| host.filled_cache(k, v, len)).collect();
                let q = noise(3 * q_row, 99);
                let out = host.decode_attention(Level::active(), &mut caches, &q);
                assert_eq!(out.len(), 3 * q_row);
                for (s, (k, v)) in kv.iter().enumerate() {
                    for h in 0..cfg.heads {
                        // The last layer's window: positions `len - window..` seen.
                        let expected = direct_attention(&cfg, &q[s * q_row + h * hd..][..hd], k, v, h / group, len.saturating_sub(window)..len, held);
                        for (d, expected) in expected.into_iter().enumerate() {
                            let got = out[s * q_row + h * hd + d] as f64;
                            assert!((got - expected).abs() < 1e-5, "{dtype:?}, {len} positions, sequence {s}, head {h}, dim {d}: {got} against {expected}");
                        }
                    }
                }
            }
        }
    }

    /// A prefill's attention over a cached prefix, every new token against its own causal range (its window's, in
    /// a sliding-window layer), against a direct softmax in f64: prefixes and chunks that start and end inside a
    /// block, a chunk of 64 positions, a tile of 8 tokens, or none of them; f32 and bf16 caches; Gemma's scale,
    /// soft-capping and windows of 37 and 5. And every level this CPU runs gives the same bits.
    #[test]
    fn prefill_attention_matches_a_direct_softmax_at_every_level() {
        for (cfg, dtype) in [(config(), DType::F32), (config(), DType::BF16), (gemma(37), DType::F32), (gemma(5), DType::F16)] {
            let (kv_row, q_row) = (cfg.kv_heads * cfg.head_dim, cfg.heads * cfg.head_dim);
            let host = HostAttention::for_shape(cfg.clone(), dtype);
            let held = |x: f32| match dtype {
                DType::F16 => half::f16::from_f32(x).to_f32(),
                DType::BF16 => half::bf16::from_f32(x).to_f32(),
                _ => x,
            };
            for (cached, new) in [(0, 1), (0, 23), (5, 11), (16, 16), (37, 29), (64, 9), (100, 70), (250, 3)] {
                let len = cached + new;
                let (k, v) = (noise(len * kv_row, 3 + len as u64), noise(len * kv_row, 7 + len as u64));
                let q = noise(new * q_row, 11 + new as u64);
                let mut cache = host.prefilled_cache(&k, &v, cached, new);
                let mut outs = Level::available().into_iter().map(|level| (level, host.prefill_attention(level, &mut cache, &q, new)));
                let (_, out) = outs.next().expect("the portable level");
                for (level, other) in outs {
                    assert!(out.iter().zip(&other).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}, {cached}+{new}: {level:?} differs from portable");
                }
                within_of_direct_attention(&cfg, &out, &q, &k, &v, cached, held, &format!("{dtype:?}, {cached}+{new}"));
            }
        }
    }

    /// The AMX level's tile attention (heads of 64 dimensions, prefills): every row within the split bf16
    /// products' bound of a direct softmax in f64, over f32 and f16 caches, a soft-capped and windowed layer, tasks
    /// of one tile of rows and several with a partial last one; and a cached prefix gives the bits of a full
    /// prefill. Skipped, and said, where the CPU or Linux gives no AMX-BF16.
    #[test]
    fn tile_attention_matches_a_direct_softmax() {
        if !tiles_available(64) {
            eprintln!("the tile attention not tested: no AMX-BF16 granted on this machine");
            return;
        }
        let wide = |c: AttentionShape| AttentionShape { head_dim: 64, out_width: c.heads * 64, rope_frequencies: (0..32).map(|i| 1.0 / 10000f64.powf(i as f64 / 32.0)).collect(), ..c };
        let mut worst = 0f64;
        for (cfg, dtype) in [(wide(config()), DType::F32), (wide(config()), DType::F16), (wide(gemma(37)), DType::F32)] {
            let (kv_row, q_row) = (cfg.kv_heads * cfg.head_dim, cfg.heads * cfg.head_dim);
            let host = HostAttention::for_shape(cfg.clone(), dtype).with_tiles(true);
            let held = |x: f32| if dtype == DType::F16 { half::f16::from_f32(x).to_f32() } else { x };
            for (cached, new) in [(0, 2), (0, 23), (5, 40), (37, 29), (100, 70)] {
                let len = cached + new;
                let (k, v) = (noise(len * kv_row, 3 + len as u64), noise(len * kv_row, 7 + len as u64));
                let q = noise(len * q_row, 11 + len as u64);
                let q_new = &q[cached * q_row..];
                let out = host.prefill_attention(Level::Amx, &mut host.prefilled_cache(&k, &v, cached, new), q_new, new);
                worst = worst.max(within_of_direct_attention(&cfg, &out, q_new, &k, &v, cached, held, &format!("{dtype:?}, {cached}+{new}")));
                // The same positions prefilled from position 0: the same bits for the last `new` tokens.
                if cached > 0 && new > 1 {
                    let full = host.prefill_attention(Level::Amx, &mut host.prefilled_cache(&k, &v, 0, len), &q, len);
                    assert!(full[cached * q_row..].iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}, {cached}+{new}: a cached prefix changes bits");
                }
            }
        }
        eprintln!("the tile attention's largest difference from an f64 softmax: {worst:e}");
    }

    /// Decodes whose caches share leading blocks (a prefix cache hit) are attended together over those blocks: at
    /// every level, the same bits as the same keys and values held apart, attended sequence by sequence. Prefixes
    /// of one chunk exactly and ending inside a block, continuations of one position to most of a chunk, two
    /// sequences that share nothing in the same step, f32 and f16 caches, one thread (groups of 4) and the default
    /// pool (groups of 2).
    #[test]
    fn decodes_sharing_a_prefix_give_the_bits_of_caches_held_apart() {
        let cfg = config();
        let (kv_row, q_row) = (cfg.kv_heads * cfg.head_dim, cfg.heads * cfg.head_dim);
        for dtype in [DType::F32, DType::F16] {
            let host = HostAttention::for_shape(cfg.clone(), dtype);
            for prefix in [64, 150] {
                let (pk, pv) = (noise(prefix * kv_row, 1 + prefix as u64), noise(prefix * kv_row, 2 + prefix as u64));
                let base = host.prefix_cache(&pk, &pv, prefix);
                // 9 continuations of the prefix, then 2 sequences of their own: (keys, values) of every position.
                let mut kv: Vec<(Vec<f32>, Vec<f32>)> = (0..9u64)
                    .map(|i| {
                        let tail = 1 + (i as usize * 7) % 50;
                        let (k, v) = (noise(tail * kv_row, 100 + i), noise(tail * kv_row, 200 + i));
                        ([&pk[..], &k[..]].concat(), [&pv[..], &v[..]].concat())
                    })
                    .collect();
                kv.extend((0..2u64).map(|i| (noise((prefix + 9) * kv_row, 300 + i), noise((prefix + 9) * kv_row, 400 + i))));
                let len = |k: &Vec<f32>| k.len() / kv_row;
                let sharing = || -> Vec<HostCache> {
                    kv.iter().enumerate().map(|(i, (k, v))| if i < 9 { host.extended_cache(&base, k, v, len(k)) } else { host.filled_cache(k, v, len(k)) }).collect()
                };
                let apart = || -> Vec<HostCache> { kv.iter().map(|(k, v)| host.filled_cache(k, v, len(k))).collect() };
                let q = noise(kv.len() * q_row, 7);
                let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
                for level in Level::available() {
                    let expected: Vec<f32> = {
                        let mut caches = apart();
                        let segments: Vec<Segment<'_, HostCache>> = caches.iter_mut().map(|cache| Segment { tokens: &[0], cache }).collect();
                        assert!(host.tasks(0, &q, &segments, TILE).iter().all(|t| t.parts.len() == 1), "caches held apart share nothing");
                        (0..cfg.layers).flat_map(|layer| host.attention(level, layer, &q, &segments)).collect::<Vec<f32>>()
                    };
                    // 9 sequences over 2 kv heads: groups of 4 for one thread's 4 tasks, of 2 (the fewest) for more.
                    let default = if rayon::current_num_threads() == 1 { 4 } else { 2 };
                    for (pool, group) in [(Some(&one), 4), (None, default)] {
                        let run = || {
                            let mut caches = sharing();
                            let segments: Vec<Segment<'_, HostCache>> = caches.iter_mut().map(|cache| Segment { tokens: &[0], cache }).collect();
                            let tasks = host.tasks(0, &q, &segments, TILE);
                            let together: Vec<(usize, usize)> = tasks.iter().filter(|t| t.parts.len() > 1).map(|t| (t.parts.len(), t.shared)).collect();
                            let out = (0..cfg.layers).flat_map(|layer| host.attention(level, layer, &q, &segments)).collect::<Vec<f32>>();
                            (together, out)
                        };
                        let (together, out) = match pool {
                            Some(p) => p.install(run),
                            None => run(),
                        };
                        // The 9 sharers in groups of `group` (the last of 1, alone), per kv head; whole chunks shared.
                        let sizes: Vec<usize> = together.iter().map(|t| t.0).collect();
                        assert_eq!(sizes, vec![group; 9 / group * cfg.kv_heads], "{dtype:?}, prefix {prefix}");
                        assert!(together.iter().all(|t| t.1 == prefix / CHUNK * CHUNK_BLOCKS), "{dtype:?}, prefix {prefix}: {together:?}");
                        assert_eq!(out.len(), expected.len());
                        for (i, (a, b)) in out.iter().zip(&expected).enumerate() {
                            let (layer, at) = (i / (kv.len() * q_row), i % (kv.len() * q_row));
                            assert_eq!(a.to_bits(), b.to_bits(), "{dtype:?}, prefix {prefix}, {level:?}, layer {layer}, sequence {}, element {}: {a} against {b}", at / q_row, at % q_row);
                        }
                    }
                }
            }
        }
    }

    /// The bytes a hint covers are the block's elements' own, and hints past them ask for nothing.
    #[test]
    fn a_hint_covers_exactly_the_elements_bytes() {
        let values: Vec<f32> = (0..48).map(|i| i as f32 * 0.5 - 3.0).collect();
        let block = KvBlock::F32(values.clone().into_boxed_slice());
        let expected: Vec<u8> = values[16..36].iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert_eq!(block.bytes(16, 20), &expected[..]);
        let halves: Vec<u16> = (0..48u16).map(|i| i * 3).collect();
        let block = KvBlock::F16(halves.clone().into_boxed_slice());
        let expected: Vec<u8> = halves[8..40].iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert_eq!(block.bytes(8, 32), &expected[..]);
        let ahead = Ahead::new(block.bytes(8, 32));
        assert_eq!(ahead.lines(), 1);
        assert_eq!(Ahead::new(&[0u8; 65]).lines(), 2);
        assert_eq!(Ahead::NONE.lines(), 0);
        for i in 0..10 {
            ahead.line(i);
            Ahead::NONE.line(i);
        }
    }
}
