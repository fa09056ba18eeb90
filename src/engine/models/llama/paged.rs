//! The paged attention backend, every accelerator's: everything in candle tensor ops on the model's device, nothing
//! read back but the step's output (the greedy tokens, one `u32` per sequence, or the logits of the rows that need
//! them).
//!
//! The KV cache is a paged pool ([`Pool`]): per layer, one keys tensor and one values tensor of
//! `[kv_heads, blocks x BLOCK, head_dim]` on the device, in the activations' dtype; a position's slot is its
//! block's id x BLOCK plus its offset in the block, and a sequence's [`PagedCache`] holds its pool blocks, in
//! position order (its block table). New keys and values are scattered into their slots; attention gathers
//! each sequence's slots along the middle dimension, which gives `[kv_heads, positions, head_dim]` with no
//! transposing copy:
//!
//! - the single-token segments of a step (decodes) together: their slots gathered into
//!   `[kv_heads, B, L, head_dim]` with `L` the longest sequence, scores masked past each sequence's own length,
//!   one batched matmul for scores and one for values;
//! - each longer segment (a prefill) on its own, with a causal mask from the segment's start.
//!
//! Queries are grouped by kv head (`[kv_head, ..., group, head_dim]`), so grouped-query attention needs no copies
//! of keys.
//! RoPE uses candle's interleaved-pair kernel with each token's own position. Scores and the softmax are in
//! f32 whatever the activations' dtype.
//!
//! The backend runs on any device; on the CPU it is what the tests check against the host backend ([`super::host`]),
//! which stays the CPU's default: it computes each block in place without gathering.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};

use super::{Attention, Backend, KvCache, Model, ModelConfig, Segment, BLOCK};

/// The paged backend: the model's shapes, RoPE tables on the device and the KV pool.
pub struct PagedAttention {
    config: ModelConfig,
    /// The attention output's width in memory (zero-padded past `heads x head_dim` in a padded layout).
    out_width: usize,
    /// cos and sin of position x frequency, `[context_length, head_dim / 2]`, in the activations' dtype.
    cos: Tensor,
    sin: Tensor,
    pool: Arc<Mutex<Pool>>,
    block_bytes: usize,
    device: Device,
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
        let shape = (self.kv_heads, self.blocks * BLOCK, self.head_dim);
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
            t.scatter_set(&to, &t.index_select(&from, 1)?, 1)?;
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

/// Attention inputs of a step, built once and used by every layer.
struct Plan {
    /// Token rows, in the step's order, of the single-token segments; and their gather table `[B x L]` with the
    /// mask `[1, B, 1, L]` (0 where visible, -inf past the sequence's length).
    decode_rows: Vec<u32>,
    decode: Option<(Tensor, Tensor, usize)>,
    /// Per longer segment: first token row, new tokens, gather table `[total]`, causal mask `[new, total]`.
    prefill: Vec<(usize, usize, Tensor, Tensor)>,
    /// `[kv_heads, tokens, head_dim]`: each new token's slot, for `scatter_set` along the slots.
    write: Tensor,
    /// Where each of the step's token rows is among the concatenated parts, when that is not where it is.
    order: Option<Tensor>,
}

/// A sequence's cache on the paged backend: the pool blocks it holds, in position order (its block table), and its
/// length. Blocks may be shared with other caches (a fork, a prefix cache hit); a shared block is copied before a
/// write into it (copy on write: only a partly filled block is ever written again). Its holds on the blocks are
/// let go when it is dropped.
pub struct PagedCache {
    ids: Vec<u32>,
    len: usize,
    pool: Arc<Mutex<Pool>>,
}

impl std::fmt::Debug for PagedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedCache").field("ids", &self.ids).field("len", &self.len).finish()
    }
}

impl KvCache for PagedCache {
    fn len(&self) -> usize {
        self.len
    }

    fn blocks(&self) -> usize {
        self.ids.len()
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
        for &id in &self.ids {
            pool.release(id);
        }
    }
}

/// A step on the paged backend: its attention tables, and the RoPE rows of its positions.
pub struct PagedStep {
    plan: Plan,
    /// `[tokens, 1, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
}

impl PagedAttention {
    /// The paged backend for a model, with a pool of `blocks` blocks of [`BLOCK`] positions (allocated on the
    /// device at the first step): the scheduler's budget, which it never books beyond.
    pub fn new(model: &Model, blocks: usize) -> candle_core::Result<PagedAttention> {
        let config = model.config.clone();
        let (device, dtype) = (model.device().clone(), model.dtype());
        let (rope_cos, rope_sin) = super::rope_tables(&config);
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
        Ok(PagedAttention {
            out_width: model.attn_width,
            cos: table(rope_cos)?,
            sin: table(rope_sin)?,
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
        let mut decode_rows = Vec::new();
        let mut decode_seqs = Vec::new();
        let mut prefill = Vec::new();
        let mut at = 0;
        for s in segments {
            let blocks = &*s.cache;
            let (start, new) = (s.cache.len, s.tokens.len());
            write.extend((start..start + new).map(|p| blocks.slot(p)));
            if new == 1 {
                decode_rows.push(at as u32);
                decode_seqs.push((blocks, start + 1));
            } else {
                let total = start + new;
                let table = Tensor::from_vec((0..total).map(|p| blocks.slot(p)).collect::<Vec<u32>>(), total, device)?;
                let mask: Vec<f32> =
                    (0..new).flat_map(|t| (0..total).map(move |p| if p <= start + t { 0.0 } else { f32::NEG_INFINITY })).collect();
                prefill.push((at, new, table, Tensor::from_vec(mask, (new, total), device)?));
            }
            at += new;
        }
        let decode = match decode_seqs.iter().map(|d| d.1).max() {
            None => None,
            Some(longest) => {
                let b = decode_seqs.len();
                let mut table = Vec::with_capacity(b * longest);
                let mut mask = Vec::with_capacity(b * longest);
                for (blocks, len) in &decode_seqs {
                    for p in 0..longest {
                        // Past a sequence's length: any row (its own first), masked out.
                        table.push(blocks.slot(if p < *len { p } else { 0 }));
                        mask.push(if p < *len { 0.0 } else { f32::NEG_INFINITY });
                    }
                }
                Some((Tensor::from_vec(table, b * longest, device)?, Tensor::from_vec(mask, (1, b, 1, longest), device)?, longest))
            }
        };
        // The parts come back decodes first, then prefills in step order; when that is not the step's order,
        // a permutation puts each row back.
        let concatenated: Vec<u32> = decode_rows.iter().copied().chain(prefill.iter().flat_map(|p| p.0 as u32..(p.0 + p.1) as u32)).collect();
        let order = match concatenated.iter().enumerate().all(|(i, &r)| r as usize == i) {
            true => None,
            false => {
                let mut inverse = vec![0u32; concatenated.len()];
                for (i, &r) in concatenated.iter().enumerate() {
                    inverse[r as usize] = i as u32;
                }
                Some(Tensor::from_vec(inverse, concatenated.len(), device)?)
            }
        };
        let write = scatter_index(write, self.config.kv_heads, self.config.head_dim, device)?;
        Ok(Plan { decode_rows, decode, prefill, write, order })
    }
}

impl Attention for PagedAttention {
    type Cache = PagedCache;
    type Step = PagedStep;
    type Block = PagedBlock;

    fn new_cache(&self, _capacity_tokens: usize) -> PagedCache {
        PagedCache { ids: Vec::new(), len: 0, pool: self.pool.clone() }
    }

    /// The same blocks, shared: the first of the two to write into a shared block copies it.
    fn fork(&self, source: &PagedCache) -> candle_core::Result<PagedCache> {
        let mut pool = lock(&self.pool);
        for &id in &source.ids {
            pool.hold(id);
        }
        Ok(PagedCache { ids: source.ids.clone(), len: source.len, pool: self.pool.clone() })
    }

    fn share_block(&self, cache: &PagedCache, index: usize) -> Option<PagedBlock> {
        let id = *cache.ids.get(index)?;
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
        PagedCache { len: ids.len() * BLOCK, ids, pool: self.pool.clone() }
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
        let cos = self.cos.index_select(&pos, 0)?.reshape((n, 1, half))?;
        let sin = self.sin.index_select(&pos, 0)?.reshape((n, 1, half))?;
        Ok(PagedStep { plan, cos, sin })
    }

    fn attend(&self, step: &PagedStep, layer: usize, qkv: [Tensor; 3], _segments: &mut [Segment<'_, PagedCache>]) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let (hd, kvh, heads) = (cfg.head_dim, cfg.kv_heads, cfg.heads);
        let group = heads / kvh;
        let scale = 1.0 / (hd as f64).sqrt();
        let plan = &step.plan;
        let [q, k, v] = qkv;
        let n = q.dim(0)?;
        let q = candle_nn::rotary_emb::rope_i(&q.reshape((n, heads, 1, hd))?, &step.cos, &step.sin)?.reshape((n, heads * hd))?;
        let k = candle_nn::rotary_emb::rope_i(&k.reshape((n, kvh, 1, hd))?, &step.cos, &step.sin)?;
        let pool = lock(&self.pool);
        let (keys, values) = (&pool.keys[layer], &pool.values[layer]);
        // `[kv_head, token, head_dim]`, the pool's order. (The pool, the queries and the hidden state share the
        // activations' dtype: the pool is made in the embedding's.)
        let by_head = |t: &Tensor| t.reshape((n, kvh, hd))?.transpose(0, 1)?.contiguous();
        keys.scatter_set(&plan.write, &by_head(&k)?, 1)?;
        values.scatter_set(&plan.write, &by_head(&v)?, 1)?;

        // Attention outputs, `[rows, heads x head_dim]`, decodes first, then each prefill.
        let mut parts = Vec::with_capacity(1 + plan.prefill.len());
        if let Some((table, mask, longest)) = &plan.decode {
            let b = plan.decode_rows.len();
            // `[kv_head, B, group, head_dim]` against `[kv_head, B, L, head_dim]`.
            let qd = super::select_rows(&q, &plan.decode_rows)?.reshape((b, kvh, group, hd))?.transpose(0, 1)?.contiguous()?;
            let gather = |t: &Tensor| t.index_select(table, 1)?.reshape((kvh, b, *longest, hd));
            let (kg, vg) = (gather(keys)?, gather(values)?);
            let scores = (qd.matmul(&kg.transpose(2, 3)?)?.to_dtype(DType::F32)? * scale)?.broadcast_add(mask)?;
            let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(vg.dtype())?;
            parts.push(p.matmul(&vg)?.transpose(0, 1)?.contiguous()?.reshape((b, heads * hd))?);
        }
        for (first, new, table, mask) in &plan.prefill {
            let total = table.dim(0)?;
            let qs = q.narrow(0, *first, *new)?.reshape((*new, kvh, group, hd))?.permute((1, 2, 0, 3))?.contiguous()?.reshape((kvh, group * new, hd))?;
            let gather = |t: &Tensor| t.index_select(table, 1);
            let (kg, vg) = (gather(keys)?, gather(values)?);
            let scores = (qs.matmul(&kg.t()?)?.to_dtype(DType::F32)? * scale)?.reshape((kvh, group, *new, total))?.broadcast_add(mask)?;
            let p = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(vg.dtype())?.reshape((kvh, group * new, total))?;
            let out = p.matmul(&vg)?.reshape((kvh, group, *new, hd))?.permute((2, 0, 1, 3))?.contiguous()?;
            parts.push(out.reshape((*new, heads * hd))?);
        }
        drop(pool);
        let attn = if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts, 0)? };
        let attn = match plan.order.as_ref() {
            Some(order) => attn.index_select(order, 0)?,
            None => attn,
        };
        if self.out_width > heads * hd {
            return attn.pad_with_zeros(1, 0, self.out_width - heads * hd);
        }
        Ok(attn)
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

/// The index tensor for `scatter_set` along the slots of a `[kv_heads, slots, head_dim]` pool: `[kv_heads,
/// slots.len(), head_dim]`, each slot repeated across heads and values.
fn scatter_index(slots: Vec<u32>, kv_heads: usize, head_dim: usize, device: &Device) -> candle_core::Result<Tensor> {
    let n = slots.len();
    Tensor::from_vec(slots, (1, n, 1), device)?.broadcast_as((kv_heads, n, head_dim))?.contiguous()
}
