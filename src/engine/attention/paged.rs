//! The paged attention backend, every accelerator's: everything in candle tensor ops on the model's device, nothing
//! read back but the step's output (the greedy tokens, one `u32` per sequence, or the logits of the rows that need
//! them).
//!
//! The KV cache is a paged pool ([`Pool`]): per layer, one keys tensor and one values tensor of
//! `[blocks x BLOCK, kv_heads, head_dim]` on the device, in the activations' dtype (flash-attention's paged layout,
//! `[blocks, BLOCK, kv_heads, head_dim]`, without a copy); a position's slot is its block's id x BLOCK plus its
//! offset in the block, and a sequence's [`PagedCache`] holds its pool blocks, in position order (its block
//! table). New keys and values are scattered into their slots.
//!
//! Attention runs in tiles, with memory bounded by the tile, not by the prompt or the batch ([`tiled`]):
//! - every segment of a step is cut into query tiles, a decode (one new token) being a tile of one query and a
//!   prefill tiles of up to [`QUERY_TILE`] queries; the tiles of all the step's decodes run together, and so do the
//!   tiles of all its prefills, in chunks whose scores fit [`SCORE_BYTES`];
//! - a chunk walks the keys [`KEY_TILE`] positions at a time: it gathers that many keys and values of each tile's
//!   sequence from the pool, scores them and folds them into a running softmax (the running maximum, sum and
//!   weighted values: flash attention's online softmax), so no score matrix of a whole prompt and no gathered copy
//!   of a whole sequence's keys ever exists;
//! - tiles are ordered longest first, so a key tile past a tile's last visible position is not computed for it.
//!
//! On CUDA the step's decodes (one new token each) are attended by nightshift's decode kernel instead, in one launch
//! per layer straight from the pool ([`super::decode`]), and only its prefills in tiles. With the
//! `flash-attn` feature, on CUDA in f16 or bf16, flash-attention's variable-length paged kernel attends every
//! segment of the step in one call straight from the pool ([`PagedAttention::flash`]). `runtime.attention =
//! "paged-tiled"` chooses the tiles for everything (the GPU check measures the kernels against them).
//!
//! Queries are grouped by kv head, so grouped-query attention needs no copies of keys. RoPE uses candle's
//! interleaved-pair kernel with each token's own position. Scores and the softmax are in f32 whatever the
//! activations' dtype.
//!
//! The backend runs on any device; on the CPU it is what the tests check against the host backend ([`super::host`]),
//! which stays the CPU's default: it computes each block in place without gathering.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};

use super::{Attention, AttentionModel, AttentionShape, Backend, KvCache, PagedKernel, Segment, BLOCK};

/// The paged backend: the model's shapes, RoPE tables on the device and the KV pool.
pub struct PagedAttention {
    config: AttentionShape,
    /// The attention output's width in memory (zero-padded past `heads x head_dim` in a padded layout).
    out_width: usize,
    /// cos and sin of position x frequency, `[context_length, head_dim / 2]`, in the activations' dtype: per set of
    /// frequencies layers use ([`AttentionShape::rope_set`]).
    rope: Vec<(Tensor, Tensor)>,
    pool: Arc<Mutex<Pool>>,
    #[cfg(feature = "flash-attn")]
    pool_blocks: usize,
    block_bytes: usize,
    device: Device,
    /// Whether flash-attention's kernel attends (CUDA, f16 or bf16, and not turned off) instead of the tiles.
    #[cfg(feature = "flash-attn")]
    flash: bool,
    /// Whether the decode kernel attends the decodes instead of the tiles.
    decode: bool,
}

/// Per layer, keys and values of every pool block, allocated at the first write; the free blocks, and how many
/// holders each block has (caches listing it, [`PagedBlock`] handles): a block is free when the last lets go.
struct Pool {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    free: Vec<u32>,
    refs: Vec<u32>,
    blocks: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl Pool {
    fn allocate(&mut self) -> candle_core::Result<()> {
        if !self.keys.is_empty() {
            return Ok(());
        }
        let shape = (self.blocks * BLOCK, self.kv_heads, self.head_dim);
        for _ in 0..self.layers {
            self.keys.push(Tensor::zeros(shape, self.dtype, &self.device)?);
            self.values.push(Tensor::zeros(shape, self.dtype, &self.device)?);
        }
        // Popped from the end: the lowest blocks first.
        self.free = (0..self.blocks as u32).rev().collect();
        self.refs = vec![0; self.blocks];
        Ok(())
    }

    /// A free block, with one holder.
    fn take(&mut self) -> Option<u32> {
        let id = self.free.pop()?;
        self.refs[id as usize] = 1;
        Some(id)
    }

    fn hold(&mut self, id: u32) {
        self.refs[id as usize] += 1;
    }

    /// One holder lets go of a block; the last frees it.
    fn release(&mut self, id: u32) {
        let r = &mut self.refs[id as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(id);
        }
    }

    /// Copies whole blocks (every layer's keys and values): `(from, to)` pairs.
    fn copy_blocks(&self, pairs: &[(u32, u32)]) -> candle_core::Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let rows = |ids: &mut dyn Iterator<Item = u32>| -> Vec<u32> { ids.flat_map(|id| (0..BLOCK as u32).map(move |c| id * BLOCK as u32 + c)).collect() };
        let from = rows(&mut pairs.iter().map(|p| p.0));
        let n = from.len();
        let from = Tensor::from_vec(from, n, &self.device)?;
        let to = scatter_index(rows(&mut pairs.iter().map(|p| p.1)), self.kv_heads, self.head_dim, &self.device)?;
        for t in self.keys.iter().chain(&self.values) {
            t.scatter_set(&to, &t.index_select(&from, 0)?, 0)?;
        }
        Ok(())
    }
}

/// A full block of a paged cache, held for the prefix cache: the pool keeps it while a handle or a cache holds it.
pub struct PagedBlock {
    id: u32,
    pool: Arc<Mutex<Pool>>,
}

impl Clone for PagedBlock {
    fn clone(&self) -> Self {
        lock(&self.pool).hold(self.id);
        PagedBlock { id: self.id, pool: self.pool.clone() }
    }
}

impl Drop for PagedBlock {
    fn drop(&mut self) {
        lock(&self.pool).release(self.id);
    }
}

fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    // The pool's state stays consistent whatever panicked while it was held (a panic cannot stop halfway
    // through a push or a pop).
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

/// Query positions of a prefill tile (a decode's tile has one).
pub const QUERY_TILE: usize = 128;
/// Key positions a tile scores at a time.
pub const KEY_TILE: usize = 512;
/// The f32 scores of one chunk of tiles against one key tile, at most (a single tile may exceed it alone).
pub const SCORE_BYTES: usize = 64 << 20;

/// Attention inputs of a step, built once and used by every layer.
struct Plan {
    /// The tiled path's chunks: the decodes' first, then the prefills'.
    chunks: Vec<Chunk>,
    /// Where each of the step's token rows is among the chunks' concatenated (padded) query rows, when that is not
    /// where it is.
    order: Option<Tensor>,
    /// `[tokens, kv_heads, head_dim]`: each new token's slot, for `scatter_set` along the slots.
    write: Tensor,
    /// flash-attention's inputs, when it runs this step.
    #[cfg(feature = "flash-attn")]
    flash: Option<FlashPlan>,
    /// The decode kernel's inputs, when it attends this step's decodes: their outputs come first, before the
    /// chunks'.
    decode: Option<DecodePlan>,
}

/// The decode kernel's inputs: the decodes' token rows (`None`: every row of the step, in order), their block
/// tables `[decodes, widest]` (padded with block 0, never read) and the positions each sees (its cache and itself).
struct DecodePlan {
    rows: Option<Tensor>,
    tables: Tensor,
    lens: Tensor,
}

/// Tiles attended together: `tiles` tiles of `tq` query rows each (a shorter tile's rows padded with its last),
/// walking the keys `tk` positions at a time.
struct Chunk {
    tiles: usize,
    tq: usize,
    tk: usize,
    /// `[tiles x tq]`: each query row's token row in the step.
    rows: Tensor,
    /// `[tiles, 1, 1, tq, 1]`, f32: each query row's position.
    positions: Tensor,
    /// Per key tile, the tiles that see any of its positions (a prefix: tiles are ordered by their last position,
    /// longest first) and their pool slots, `[active x tk]` (a slot past a tile's sequence is any slot, masked).
    keys: Vec<(usize, Tensor)>,
    /// `[1, 1, 1, 1, max keys]`, f32: 0, 1, 2, ...
    key_positions: Tensor,
}

/// flash-attention's varlen paged inputs: cumulative query and key lengths `[segments + 1]`, the block tables
/// `[segments, most blocks]`, the longest query run and the longest sequence.
#[cfg(feature = "flash-attn")]
struct FlashPlan {
    seqlens_q: Tensor,
    seqlens_k: Tensor,
    block_table: Tensor,
    max_q: usize,
    max_k: usize,
}

/// flash-attention's varlen paged tables, on the host: every segment's new tokens are a run of the queries and
/// its whole sequence (the cache and the new positions) its keys, through its block table. Cumulative query and
/// key lengths (`segments + 1` each), the block tables padded with block 0 to the widest (`segments x width`), the
/// longest query run and the longest sequence.
#[derive(Debug, PartialEq)]
struct FlashTables {
    seqlens_q: Vec<u32>,
    seqlens_k: Vec<u32>,
    block_table: Vec<u32>,
    width: usize,
    max_q: usize,
    max_k: usize,
}

/// [`FlashTables`] of a step's segments: each its cache's length, its new tokens and its block ids (the blocks of
/// the new positions booked already).
#[cfg_attr(not(feature = "flash-attn"), allow(dead_code))]
fn flash_tables<'a>(segments: impl Iterator<Item = (usize, usize, &'a [u32])> + Clone) -> FlashTables {
    let (block_table, width) = block_tables(segments.clone().map(|s| s.2));
    let mut t = FlashTables { seqlens_q: vec![0], seqlens_k: vec![0], block_table, width, max_q: 0, max_k: 0 };
    for (len, new, _) in segments {
        let total = len + new;
        t.seqlens_q.push(t.seqlens_q.last().copied().unwrap_or(0) + new as u32);
        t.seqlens_k.push(t.seqlens_k.last().copied().unwrap_or(0) + total as u32);
        (t.max_q, t.max_k) = (t.max_q.max(new), t.max_k.max(total));
    }
    t
}

/// Sequences' block tables as one `[sequences, width]` table, each padded with block 0 (never read: past its
/// sequence) to the widest; and that width (at least 1).
fn block_tables<'a>(tables: impl Iterator<Item = &'a [u32]> + Clone) -> (Vec<u32>, usize) {
    let width = tables.clone().map(<[u32]>::len).max().unwrap_or(1).max(1);
    (tables.flat_map(|ids| ids.iter().copied().chain(std::iter::repeat(0)).take(width)).collect(), width)
}

/// One query tile while a step is planned: its first token row, its query count, the position of its first query
/// and its sequence's cache (the block table).
struct Tile<'c> {
    row: usize,
    queries: usize,
    first: usize,
    cache: &'c PagedCache,
}

impl Tile<'_> {
    /// Positions the tile sees: up to its last query's.
    fn visible(&self) -> usize {
        self.first + self.queries
    }
}

/// The chunks of one group of tiles (all of one step's decodes, or all of its prefills), `tq` queries per tile.
/// `rows_at`: where the group's first padded query row lands among every chunk's; each token row's place is
/// written into `place`.
fn chunks(mut tiles: Vec<Tile<'_>>, tq: usize, heads: usize, rows_at: &mut usize, place: &mut [u32], device: &Device) -> candle_core::Result<Vec<Chunk>> {
    // Longest first, so each key tile's tiles are a prefix; a stable sort keeps the step's order among equals.
    tiles.sort_by_key(|t| std::cmp::Reverse(t.visible()));
    let longest = tiles.first().map_or(0, Tile::visible);
    // The key tile: no longer than the longest sequence needs (rounded up to whole blocks).
    let tk = KEY_TILE.min(longest.next_multiple_of(BLOCK)).max(BLOCK);
    let per_tile = heads * tq * tk * 4;
    let per_chunk = (SCORE_BYTES / per_tile.max(1)).max(1);
    let mut out = Vec::new();
    for group in tiles.chunks(per_chunk) {
        let mut rows = Vec::with_capacity(group.len() * tq);
        let mut positions = Vec::with_capacity(group.len() * tq);
        for (i, t) in group.iter().enumerate() {
            for q in 0..tq {
                // Padding rows repeat the tile's last query: always a position with something visible.
                let q_in = q.min(t.queries - 1);
                rows.push((t.row + q_in) as u32);
                positions.push((t.first + q_in) as f32);
                if q < t.queries {
                    place[t.row + q] = (*rows_at + i * tq + q) as u32;
                }
            }
        }
        *rows_at += group.len() * tq;
        let longest = group[0].visible();
        let mut keys = Vec::new();
        for start in (0..longest).step_by(tk) {
            let active = group.iter().take_while(|t| t.visible() > start).count();
            let mut slots = Vec::with_capacity(active * tk);
            for t in &group[..active] {
                let ids = &t.cache.ids;
                for p in start..start + tk {
                    // Past the sequence's blocks: its first slot (masked: past every query's position).
                    let block = ids.get(p / BLOCK).copied().unwrap_or(ids[0]);
                    slots.push(block * BLOCK as u32 + (p % BLOCK) as u32);
                }
            }
            keys.push((active, Tensor::from_vec(slots, active * tk, device)?));
        }
        let n = group.len();
        let spans = longest.div_ceil(tk) * tk;
        out.push(Chunk {
            tiles: n,
            tq,
            tk,
            rows: Tensor::from_vec(rows, n * tq, device)?,
            positions: Tensor::from_vec(positions, (n, 1, 1, tq, 1), device)?,
            keys,
            key_positions: Tensor::arange(0u32, spans as u32, device)?.to_dtype(DType::F32)?.reshape((1, 1, 1, 1, spans))?,
        });
    }
    Ok(out)
}

/// A sequence's cache on the paged backend: the pool blocks it holds, in position order (its block table), and its
/// length. Blocks may be shared with other caches (a fork, a prefix cache hit); a shared block is copied before a
/// write into it (copy on write: only a partly filled block is ever written again). Its holds on the blocks are
/// let go when it is dropped.
pub struct PagedCache {
    /// Every block from position 0; the first `released` are let go ([`Attention::release_before`]): not held,
    /// never written, and read only where masked (the tiled path gathers whole key tiles), so whatever the pool
    /// holds there now does not count.
    ids: Vec<u32>,
    released: usize,
    len: usize,
    pool: Arc<Mutex<Pool>>,
}

impl std::fmt::Debug for PagedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedCache").field("ids", &self.ids).field("released", &self.released).field("len", &self.len).finish()
    }
}

impl KvCache for PagedCache {
    fn len(&self) -> usize {
        self.len
    }

    fn blocks(&self) -> usize {
        self.ids.len() - self.released
    }
}

impl PagedCache {
    /// The pool slot of a position.
    fn slot(&self, pos: usize) -> u32 {
        self.ids[pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32
    }
}

impl Drop for PagedCache {
    fn drop(&mut self) {
        let mut pool = lock(&self.pool);
        for &id in &self.ids[self.released..] {
            pool.release(id);
        }
    }
}

/// A step on the paged backend: its attention tables, and the RoPE rows of its positions.
pub struct PagedStep {
    plan: Plan,
    /// cos and sin `[tokens, 1, head_dim / 2]`, per set of RoPE frequencies.
    rope: Vec<(Tensor, Tensor)>,
}

impl PagedAttention {
    /// The paged backend for a model, with a pool of `blocks` blocks of [`BLOCK`] positions (allocated on the
    /// device at the first step): the scheduler's budget, which it never books beyond.
    pub fn new(model: &impl AttentionModel, blocks: usize) -> candle_core::Result<PagedAttention> {
        Self::with_kernel(model, blocks, PagedKernel::best(model))
    }

    /// [`PagedAttention::new`] with a kernel: flash-attention's (where [`PagedAttention::flash_available`]), the
    /// decode kernel (where [`PagedAttention::decode_available`]: on the CPU its reference) or the tiles; one that
    /// cannot run here falls back to the tiles. ([`PagedAttention::new`] takes the decode kernel on CUDA only.)
    pub fn with_kernel(model: &impl AttentionModel, blocks: usize, kernel: PagedKernel) -> candle_core::Result<PagedAttention> {
        let config = model.attention_shape().clone();
        let (device, dtype) = (model.device().clone(), model.dtype());
        let half = config.head_dim / 2;
        let table = |v: Vec<f32>| Tensor::from_vec(v, (config.context_length, half), &device)?.to_dtype(dtype);
        let pool = Pool {
            keys: Vec::new(),
            values: Vec::new(),
            free: Vec::new(),
            refs: Vec::new(),
            blocks: blocks.max(1),
            layers: config.layers,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
            dtype,
            device: device.clone(),
        };
        #[cfg(feature = "flash-attn")]
        let flash = kernel == PagedKernel::Flash && Self::flash_available(&device, dtype);
        let decode = kernel == PagedKernel::Decode && Self::decode_available(model);
        Ok(PagedAttention {
            decode,
            #[cfg(feature = "flash-attn")]
            flash,
            #[cfg(feature = "flash-attn")]
            pool_blocks: blocks.max(1),
            out_width: config.out_width,
            rope: config.rope_sets().into_iter().map(|(cos, sin)| Ok((table(cos)?, table(sin)?))).collect::<candle_core::Result<_>>()?,
            pool: Arc::new(Mutex::new(pool)),
            block_bytes: Backend::Paged.block_bytes(model, model.dtype()),
            config,
            device,
        })
    }

    /// Takes the blocks the step's new positions need, for every segment or (when the pool is short) none: new
    /// blocks, and a copy of a shared block a segment writes into.
    fn book(&self, segments: &mut [Segment<'_, PagedCache>]) -> candle_core::Result<()> {
        let mut pool = lock(&self.pool);
        pool.allocate()?;
        // The block holding a segment's first new position, when it exists and another cache holds it too.
        let shared_at = |pool: &Pool, c: &PagedCache| -> Option<usize> {
            let b = c.len / BLOCK;
            (!c.len.is_multiple_of(BLOCK) && b < c.ids.len() && pool.refs[c.ids[b] as usize] > 1).then_some(b)
        };
        // Copies: a shared block is copied by each segment writing into it, except the last of its holders when all
        // of them write in this step (it finds the block its own by then).
        let mut writers: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        for s in segments.iter() {
            if let Some(b) = shared_at(&pool, s.cache) {
                *writers.entry(s.cache.ids[b]).or_default() += 1;
            }
        }
        let copies: usize = writers.iter().map(|(&id, &w)| if w >= pool.refs[id as usize] as usize { w - 1 } else { w }).sum();
        let needed = copies + segments.iter().map(|s| (s.cache.len + s.tokens.len()).div_ceil(BLOCK).saturating_sub(s.cache.ids.len())).sum::<usize>();
        if needed > pool.free.len() {
            candle_core::bail!("the KV pool has {} free blocks, the step needs {needed}", pool.free.len());
        }
        let mut copies = Vec::new();
        for s in segments.iter_mut() {
            if let Some(b) = shared_at(&pool, s.cache) {
                let copy = pool.take().expect("counted above");
                copies.push((s.cache.ids[b], copy));
                pool.release(s.cache.ids[b]);
                s.cache.ids[b] = copy;
            }
            let needed = (s.cache.len + s.tokens.len()).div_ceil(BLOCK);
            while s.cache.ids.len() < needed {
                let id = pool.take().expect("counted above");
                s.cache.ids.push(id);
            }
        }
        pool.copy_blocks(&copies)
    }

    /// The step's attention tables (after its blocks are allocated; positions from each cache's current length).
    fn plan(&self, segments: &[Segment<'_, PagedCache>]) -> candle_core::Result<Plan> {
        let device = &self.device;
        let mut write = Vec::new();
        let mut decodes = Vec::new();
        let mut prefills = Vec::new();
        let mut longest_prefill = 0;
        let mut row = 0;
        for s in segments {
            let (start, new) = (s.cache.len, s.tokens.len());
            write.extend((start..start + new).map(|p| s.cache.slot(p)));
            if new == 1 {
                decodes.push(Tile { row, queries: 1, first: start, cache: &*s.cache });
            } else {
                longest_prefill = longest_prefill.max(new);
                for at in (0..new).step_by(QUERY_TILE) {
                    let queries = QUERY_TILE.min(new - at);
                    prefills.push(Tile { row: row + at, queries, first: start + at, cache: &*s.cache });
                }
            }
            row += new;
        }
        let write = scatter_index(write, self.config.kv_heads, self.config.head_dim, device)?;
        #[cfg(feature = "flash-attn")]
        if self.flash {
            let flash = Some(self.flash_plan(segments)?);
            return Ok(Plan { chunks: Vec::new(), order: None, write, flash, decode: None });
        }
        let heads = self.config.heads;
        let (mut rows_at, mut place) = (0, vec![0u32; row]);
        let mut decode = None;
        let mut chunks_ = Vec::new();
        if self.decode && !decodes.is_empty() {
            // In step order: the kernel's output rows are the decodes', first among the parts.
            let n = decodes.len();
            let (tables, width) = block_tables(decodes.iter().map(|d| &d.cache.ids[..]));
            let (mut lens, mut rows) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for (i, d) in decodes.iter().enumerate() {
                lens.push(d.visible() as u32);
                rows.push(d.row as u32);
                place[d.row] = i as u32;
            }
            rows_at = n;
            decode = Some(DecodePlan {
                rows: if n == row { None } else { Some(Tensor::from_vec(rows, n, device)?) },
                tables: Tensor::from_vec(tables, (n, width), device)?,
                lens: Tensor::from_vec(lens, n, device)?,
            });
        } else {
            chunks_ = chunks(decodes, 1, heads, &mut rows_at, &mut place, device)?;
        }
        // A prefill's tiles hold QUERY_TILE queries, or the longest prefill's when all are shorter.
        chunks_.extend(chunks(prefills, QUERY_TILE.min(longest_prefill).max(1), heads, &mut rows_at, &mut place, device)?);
        let order = match rows_at == row && place.iter().enumerate().all(|(i, &r)| r as usize == i) {
            true => None,
            false => Some(Tensor::from_vec(place, row, device)?),
        };
        Ok(Plan {
            chunks: chunks_,
            order,
            write,
            #[cfg(feature = "flash-attn")]
            flash: None,
            decode,
        })
    }

    /// The attention output at the model's laid-out width (zero-padded past `heads x head_dim`).
    fn padded(&self, attn: Tensor) -> candle_core::Result<Tensor> {
        let width = self.config.heads * self.config.head_dim;
        match self.out_width > width {
            true => attn.pad_with_zeros(1, 0, self.out_width - width),
            false => Ok(attn),
        }
    }

    /// Whether flash-attention's paged kernel can attend for a model on `device` in `dtype`: a build with the
    /// `flash-attn` feature, CUDA, f16 or bf16.
    pub fn flash_available(device: &Device, dtype: DType) -> bool {
        cfg!(feature = "flash-attn") && device.is_cuda() && matches!(dtype, DType::F16 | DType::BF16)
    }

    /// Whether the decode kernel can attend a model's decodes: CUDA in a build with the `cuda` feature (or the
    /// CPU, where its reference runs), heads it takes ([`super::decode::takes_heads`]), any dtype.
    pub fn decode_available(model: &impl AttentionModel) -> bool {
        let s = model.attention_shape();
        let device = model.device();
        ((cfg!(feature = "cuda") && device.is_cuda()) || device.is_cpu()) && super::decode::takes_heads(s.heads, s.kv_heads, s.head_dim)
    }

    /// flash-attention's inputs for a step, uploaded ([`flash_tables`]).
    #[cfg(feature = "flash-attn")]
    fn flash_plan(&self, segments: &[Segment<'_, PagedCache>]) -> candle_core::Result<FlashPlan> {
        let device = &self.device;
        let t = flash_tables(segments.iter().map(|s| (s.cache.len, s.tokens.len(), &s.cache.ids[..])));
        let n = segments.len();
        Ok(FlashPlan {
            seqlens_q: Tensor::from_vec(t.seqlens_q, n + 1, device)?,
            seqlens_k: Tensor::from_vec(t.seqlens_k, n + 1, device)?,
            block_table: Tensor::from_vec(t.block_table, (n, t.width), device)?,
            max_q: t.max_q,
            max_k: t.max_k,
        })
    }

    /// One chunk of tiles against the pool (`q`: the step's rotated queries, `[tokens, heads x head_dim]`): the
    /// attention output of its padded query rows, `[tiles x tq, heads x head_dim]`.
    fn tiled(&self, chunk: &Chunk, layer: usize, q: &Tensor, keys: &Tensor, values: &Tensor) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let (hd, kvh, heads) = (cfg.head_dim, cfg.kv_heads, cfg.heads);
        let group = heads / kvh;
        let (n, tq, tk) = (chunk.tiles, chunk.tq, chunk.tk);
        let gq = group * tq;
        let scale = f64::from(cfg.scale);
        // `[tiles, kv_head, group x tq, head_dim]`: a tile's queries of one kv head's group, together.
        let qt = q.index_select(&chunk.rows, 0)?.reshape((n, tq, kvh, group, hd))?.permute((0, 2, 3, 1, 4))?.contiguous()?.reshape((n, kvh, gq, hd))?;
        // The running maximum and sum `[active, kv_head, group x tq, 1]` and the weighted values
        // `[active, kv_head, group x tq, head_dim]`, f32; and the finished tiles' outputs, last tiles first.
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        let mut done = Vec::new();
        for (j, (active, slots)) in chunk.keys.iter().enumerate() {
            let a = *active;
            if let Some((m, l, acc)) = state.take() {
                let before = m.dim(0)?;
                if a < before {
                    done.push(acc.narrow(0, a, before - a)?.broadcast_div(&l.narrow(0, a, before - a)?)?);
                }
                state = Some((m.narrow(0, 0, a)?, l.narrow(0, 0, a)?, acc.narrow(0, 0, a)?));
            }
            // `[active, kv_head, tk, head_dim]`: the key tile of each active tile's sequence.
            let gather = |t: &Tensor| t.index_select(slots, 0)?.reshape((a, tk, kvh, hd))?.transpose(1, 2)?.contiguous();
            let (kg, vg) = (gather(keys)?, gather(values)?);
            let scores = (qt.narrow(0, 0, a)?.matmul(&kg.transpose(2, 3)?)?.to_dtype(DType::F32)? * scale)?;
            let scores = match cfg.softcap {
                Some(cap) => ((scores / f64::from(cap))?.tanh()? * f64::from(cap))?,
                None => scores,
            };
            // Masked: key positions past each query's own (past its sequence, for the longest's padding), and in a
            // sliding-window layer those `window` or more before it.
            let (key_positions, positions) = (chunk.key_positions.narrow(4, j * tk, tk)?, chunk.positions.narrow(0, 0, a)?);
            let mut hidden = key_positions.broadcast_gt(&positions)?.to_dtype(DType::F32)?;
            if let Some(window) = cfg.window(layer) {
                let early = key_positions.broadcast_le(&(positions - window as f64)?)?.to_dtype(DType::F32)?;
                hidden = hidden.broadcast_add(&early)?;
            }
            let bias = (hidden * MASKED)?;
            let scores = scores.reshape((a, kvh, group, tq, tk))?.broadcast_add(&bias)?.reshape((a, kvh, gq, tk))?;
            let top = scores.max_keepdim(3)?;
            let (m, carried) = match &state {
                None => (top, None),
                Some((m, l, acc)) => {
                    let m_new = m.maximum(&top)?;
                    let alpha = (m - &m_new)?.exp()?;
                    (m_new, Some((l.broadcast_mul(&alpha)?, acc.broadcast_mul(&alpha)?)))
                }
            };
            let p = scores.broadcast_sub(&m)?.exp()?;
            let sum = p.sum_keepdim(3)?;
            let weighted = p.to_dtype(vg.dtype())?.matmul(&vg)?.to_dtype(DType::F32)?;
            state = Some(match carried {
                None => (m, sum, weighted),
                Some((l, acc)) => (m, (l + sum)?, (acc + weighted)?),
            });
        }
        let (_, l, acc) = state.ok_or_else(|| candle_core::Error::Msg("a chunk with no key tiles (a bug)".into()))?;
        done.push(acc.broadcast_div(&l)?);
        done.reverse();
        let out = if done.len() == 1 { done.pop().expect("one part") } else { Tensor::cat(&done, 0)? };
        // Back to `[tiles x tq, heads x head_dim]`, rows in tile order.
        out.to_dtype(q.dtype())?.reshape((n, kvh, group, tq, hd))?.permute((0, 3, 1, 2, 4))?.contiguous()?.reshape((n * tq, heads * hd))
    }

    /// The step's attention by flash-attention's varlen paged kernel, straight from the pool: `[tokens, heads x
    /// head_dim]` in step order.
    #[cfg(feature = "flash-attn")]
    fn flash(&self, f: &FlashPlan, layer: usize, q: &Tensor, keys: &Tensor, values: &Tensor) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let (hd, kvh, heads) = (cfg.head_dim, cfg.kv_heads, cfg.heads);
        let n = q.dim(0)?;
        let paged = |t: &Tensor| t.reshape((self.pool_blocks, BLOCK, kvh, hd));
        let out = candle_flash_attn::flash_attn_varlen_paged_windowed(
            &q.reshape((n, heads, hd))?,
            &paged(keys)?,
            &paged(values)?,
            &f.seqlens_q,
            &f.seqlens_k,
            &f.block_table,
            None,
            f.max_q,
            f.max_k,
            cfg.scale,
            // A sliding-window layer's queries see their own position and the `window - 1` before it.
            cfg.window(layer).map(|w| w - 1),
            Some(0),
            BLOCK,
            cfg.softcap,
        )?;
        out.reshape((n, heads * hd))
    }
}

/// The bias of a masked score: exp of it less any real score's maximum is 0 (finite, unlike -inf, so a key tile
/// that hides every position of a row adds nothing instead of a NaN).
const MASKED: f64 = -1e30;

impl Attention for PagedAttention {
    type Cache = PagedCache;
    type Step = PagedStep;
    type Block = PagedBlock;

    fn new_cache(&self, _capacity_tokens: usize) -> PagedCache {
        PagedCache { ids: Vec::new(), released: 0, len: 0, pool: self.pool.clone() }
    }

    /// The same blocks, shared: the first of the two to write into a shared block copies it.
    fn fork(&self, source: &PagedCache) -> candle_core::Result<PagedCache> {
        let mut pool = lock(&self.pool);
        for &id in &source.ids[source.released..] {
            pool.hold(id);
        }
        Ok(PagedCache { ids: source.ids.clone(), released: source.released, len: source.len, pool: self.pool.clone() })
    }

    fn share_block(&self, cache: &PagedCache, index: usize) -> Option<PagedBlock> {
        let id = *cache.ids.get(index).filter(|_| index >= cache.released)?;
        lock(&self.pool).hold(id);
        Some(PagedBlock { id, pool: self.pool.clone() })
    }

    fn cache_from_blocks(&self, blocks: Vec<PagedBlock>, _capacity_tokens: usize) -> PagedCache {
        let ids: Vec<u32> = blocks.iter().map(|b| b.id).collect();
        let mut pool = lock(&self.pool);
        for &id in &ids {
            pool.hold(id);
        }
        drop(pool);
        // The handles let go after the cache holds the blocks.
        drop(blocks);
        PagedCache { len: ids.len() * BLOCK, ids, released: 0, pool: self.pool.clone() }
    }

    fn release_before(&self, cache: &mut PagedCache, blocks: usize) {
        let end = blocks.min(cache.ids.len());
        if end > cache.released {
            let mut pool = lock(&self.pool);
            for &id in &cache.ids[cache.released..end] {
                pool.release(id);
            }
            cache.released = end;
        }
    }

    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn begin(&self, segments: &mut [Segment<'_, PagedCache>], positions: &[usize]) -> candle_core::Result<PagedStep> {
        self.book(segments)?;
        let plan = self.plan(segments)?;
        let n = positions.len();
        let pos = Tensor::from_vec(positions.iter().map(|&p| p as u32).collect::<Vec<u32>>(), n, &self.device)?;
        let half = self.config.head_dim / 2;
        let rows = |t: &Tensor| t.index_select(&pos, 0)?.reshape((n, 1, half));
        let rope = self.rope.iter().map(|(cos, sin)| Ok((rows(cos)?, rows(sin)?))).collect::<candle_core::Result<_>>()?;
        Ok(PagedStep { plan, rope })
    }

    fn attend(&self, step: &PagedStep, layer: usize, qkv: [Tensor; 3], _segments: &mut [Segment<'_, PagedCache>]) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let (hd, kvh, heads) = (cfg.head_dim, cfg.kv_heads, cfg.heads);
        let plan = &step.plan;
        let [q, k, v] = qkv;
        let n = q.dim(0)?;
        let (cos, sin) = &step.rope[cfg.rope_set(layer)];
        let q = candle_nn::rotary_emb::rope_i(&q.reshape((n, heads, 1, hd))?, cos, sin)?.reshape((n, heads * hd))?;
        let k = candle_nn::rotary_emb::rope_i(&k.reshape((n, kvh, 1, hd))?, cos, sin)?;
        let pool = lock(&self.pool);
        let (keys, values) = (&pool.keys[layer], &pool.values[layer]);
        // `[token, kv_head, head_dim]`, the pool's order. (The pool, the queries and the hidden state share the
        // activations' dtype: the pool is made in the embedding's.)
        keys.scatter_set(&plan.write, &k.reshape((n, kvh, hd))?.contiguous()?, 0)?;
        values.scatter_set(&plan.write, &v.reshape((n, kvh, hd))?.contiguous()?, 0)?;
        #[cfg(feature = "flash-attn")]
        if let Some(f) = &plan.flash {
            let attn = self.flash(f, layer, &q, keys, values)?;
            drop(pool);
            return self.padded(attn);
        }
        let mut parts = Vec::with_capacity(plan.chunks.len() + 1);
        if let Some(d) = &plan.decode {
            let qd = match &d.rows {
                Some(rows) => q.index_select(rows, 0)?,
                None => q.clone(),
            };
            let shape = super::decode::DecodeShape {
                heads,
                kv_heads: kvh,
                head_dim: hd,
                block: BLOCK,
                scale: cfg.scale,
                softcap: cfg.softcap,
                window: cfg.window(layer),
            };
            parts.push(super::decode::paged_decode(&qd, keys, values, &d.tables, &d.lens, shape)?);
        }
        for chunk in &plan.chunks {
            parts.push(self.tiled(chunk, layer, &q, keys, values)?);
        }
        drop(pool);
        let attn = if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts, 0)? };
        let attn = match plan.order.as_ref() {
            Some(order) => attn.index_select(order, 0)?,
            None => attn,
        };
        self.padded(attn)
    }

    fn advance(&self, segments: &mut [Segment<'_, PagedCache>]) {
        for s in segments.iter_mut() {
            s.cache.len += s.tokens.len();
        }
    }

    fn device_argmax(&self) -> bool {
        true
    }
}

/// The index tensor for `scatter_set` along the slots of a `[slots, kv_heads, head_dim]` pool: `[slots.len(),
/// kv_heads, head_dim]`, each slot repeated across heads and values.
fn scatter_index(slots: Vec<u32>, kv_heads: usize, head_dim: usize, device: &Device) -> candle_core::Result<Tensor> {
    let n = slots.len();
    Tensor::from_vec(slots, (n, 1, 1), device)?.broadcast_as((n, kv_heads, head_dim))?.contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decode of a 40-position sequence (3 blocks with the new position), a 20-token prefill from nothing, and a
    /// 5-token prefill after a 16-position cached prefix.
    #[test]
    fn flash_tables_run_every_segment_against_its_whole_sequence() {
        let blocks: [&[u32]; 3] = [&[7, 2, 9], &[4, 5], &[1, 3]];
        let t = flash_tables([(39, 1, blocks[0]), (0, 20, blocks[1]), (16, 5, blocks[2])].into_iter());
        assert_eq!(t.seqlens_q, [0, 1, 21, 26]);
        assert_eq!(t.seqlens_k, [0, 40, 60, 81]);
        assert_eq!(t.block_table, [7, 2, 9, 4, 5, 0, 1, 3, 0]);
        assert_eq!((t.width, t.max_q, t.max_k), (3, 20, 40));
    }
}
