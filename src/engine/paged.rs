//! The forward pass for accelerators: everything in candle tensor ops on the model's device, nothing read back
//! but the step's output (the greedy tokens, one `u32` per sequence, or the logits of the rows that need them).
//!
//! The KV cache is a paged pool ([`Pool`]): per layer, one keys tensor and one values tensor of
//! `[kv_heads, blocks x BLOCK, head_dim]` on the device, in the activations' dtype; a position's slot is its
//! block's id x BLOCK plus its offset in the block, and a sequence's [`Blocks`] are the pool blocks it holds, in
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
//! The path runs on any device; on the CPU it is what the tests check against the CPU path ([`super::Model`]'s
//! own attention), which stays the CPU's default: it computes each block in place without gathering.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor, D};

use super::{Model, Segment, BLOCK};

/// The KV pool's blocks when nothing set its size ([`Model::set_kv_blocks`]): enough for tests.
const DEFAULT_POOL_BLOCKS: usize = 256;

/// The device state of the paged path: RoPE tables and the KV pool.
pub(super) struct Paged {
    /// cos and sin of position x frequency, `[context_length, head_dim / 2]`, in the activations' dtype.
    cos: Tensor,
    sin: Tensor,
    pool: Arc<Mutex<Pool>>,
}

/// Per layer, keys and values of every pool block, allocated at the first write; and the free blocks.
pub(super) struct Pool {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    free: Vec<u32>,
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
        Ok(())
    }
}

fn lock(pool: &Mutex<Pool>) -> MutexGuard<'_, Pool> {
    // The pool's state stays consistent whatever panicked while it was held (a panic cannot stop halfway
    // through a push or a pop).
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

/// The pool blocks of one sequence, in position order; returned to the pool when dropped.
pub struct Blocks {
    ids: Vec<u32>,
    pool: Arc<Mutex<Pool>>,
}

impl std::fmt::Debug for Blocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocks").field("ids", &self.ids).finish()
    }
}

impl Blocks {
    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }

    /// The pool slot of a position.
    fn slot(&self, pos: usize) -> u32 {
        self.ids[pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        lock(&self.pool).free.append(&mut self.ids);
    }
}

impl Paged {
    pub(super) fn new(model_config: &super::ModelConfig, rope_cos: &[f32], rope_sin: &[f32], dtype: DType, device: &Device) -> candle_core::Result<Paged> {
        let half = model_config.head_dim / 2;
        let table = |v: &[f32]| Tensor::from_slice(v, (model_config.context_length, half), device)?.to_dtype(dtype);
        let pool = Pool {
            keys: Vec::new(),
            values: Vec::new(),
            free: Vec::new(),
            blocks: DEFAULT_POOL_BLOCKS,
            layers: model_config.layers,
            kv_heads: model_config.kv_heads,
            head_dim: model_config.head_dim,
            dtype,
            device: device.clone(),
        };
        Ok(Paged { cos: table(rope_cos)?, sin: table(rope_sin)?, pool: Arc::new(Mutex::new(pool)) })
    }

    /// Sets the pool's size in blocks; only before its first use (afterwards, an error).
    pub(super) fn set_blocks(&self, blocks: usize) -> candle_core::Result<()> {
        let mut pool = lock(&self.pool);
        if !pool.keys.is_empty() && pool.blocks != blocks {
            candle_core::bail!("the KV pool is already allocated with {} blocks", pool.blocks);
        }
        pool.blocks = blocks.max(1);
        Ok(())
    }

    pub(super) fn empty(&self) -> Blocks {
        Blocks { ids: Vec::new(), pool: self.pool.clone() }
    }

    /// A copy of a sequence's blocks (a fork): new blocks holding the same rows.
    pub(super) fn fork(&self, source: &Blocks) -> candle_core::Result<Blocks> {
        if source.ids.is_empty() {
            return Ok(self.empty());
        }
        let mut pool = lock(&self.pool);
        if pool.free.len() < source.ids.len() {
            candle_core::bail!("the KV pool has {} free blocks, a fork needs {}", pool.free.len(), source.ids.len());
        }
        let at = pool.free.len() - source.ids.len();
        let ids: Vec<u32> = pool.free.split_off(at);
        let copy = Blocks { ids, pool: self.pool.clone() };
        let rows = |b: &Blocks| -> Vec<u32> { (0..b.ids.len() * BLOCK).map(|p| b.slot(p)).collect() };
        let n = source.ids.len() * BLOCK;
        let from = Tensor::from_vec(rows(source), n, &pool.device)?;
        let to = scatter_index(rows(&copy), pool.kv_heads, pool.head_dim, &pool.device)?;
        for t in pool.keys.iter().chain(&pool.values) {
            t.scatter_set(&to, &t.index_select(&from, 1)?, 1)?;
        }
        drop(pool);
        Ok(copy)
    }
}

/// What one output row of a step comes back as.
#[derive(Clone, Debug, PartialEq)]
pub enum StepLogits {
    /// The logits, f32.
    Full(Vec<f32>),
    /// The greedy token (argmax on the device).
    Argmax(u32),
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

impl Model {
    /// The paged forward pass; `greedy[i]` asks for segment `i`'s argmax instead of its logits (only for
    /// segments with one output).
    pub(super) fn forward_paged(&self, paged: &Paged, segments: &mut [Segment<'_>], outputs: &[usize], greedy: &[bool]) -> candle_core::Result<Vec<Vec<StepLogits>>> {
        let cfg = &self.config;
        let (positions, tokens) = self.check_segments(segments, outputs)?;
        if segments.iter().any(|s| s.cache.paged().is_none()) {
            candle_core::bail!("a CPU-path KV cache in a paged forward pass");
        }
        let n = tokens.len();
        let device = &self.device;
        let (hd, kvh, heads) = (cfg.head_dim, cfg.kv_heads, cfg.heads);
        let group = heads / kvh;

        // Blocks for the new positions, then the step's tables.
        let plan = {
            let mut pool = lock(&paged.pool);
            pool.allocate()?;
            let needed: usize = segments
                .iter()
                .map(|s| {
                    let blocks = s.cache.paged().map_or(0, Blocks::len);
                    (s.cache.len + s.tokens.len()).div_ceil(BLOCK).saturating_sub(blocks)
                })
                .sum();
            if needed > pool.free.len() {
                candle_core::bail!("the KV pool has {} free blocks, the step needs {needed}", pool.free.len());
            }
            for s in segments.iter_mut() {
                let needed = (s.cache.len + s.tokens.len()).div_ceil(BLOCK);
                let blocks = s.cache.paged_mut().expect("checked above");
                while blocks.ids.len() < needed {
                    blocks.ids.push(pool.free.pop().expect("counted above"));
                }
            }
            drop(pool);
            self.plan(segments)?
        };

        let ids = Tensor::from_vec(tokens, n, device)?;
        let pos = Tensor::from_vec(positions.iter().map(|&p| p as u32).collect::<Vec<u32>>(), n, device)?;
        let half = hd / 2;
        let cos = paged.cos.index_select(&pos, 0)?.reshape((n, 1, half))?;
        let sin = paged.sin.index_select(&pos, 0)?.reshape((n, 1, half))?;
        let mut x = self.embedding.index_select(&ids, 0)?;
        let eps = cfg.rms_eps * (cfg.hidden_size as f32 / self.width as f32);
        let scale = 1.0 / (hd as f64).sqrt();
        let pool = lock(&paged.pool);
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let [q, k, v] = layer.qkv(&h, hd, cfg.rms_eps)?;
            let q = candle_nn::rotary_emb::rope_i(&q.reshape((n, heads, 1, hd))?, &cos, &sin)?.reshape((n, heads * hd))?;
            let k = candle_nn::rotary_emb::rope_i(&k.reshape((n, kvh, 1, hd))?, &cos, &sin)?;
            let (keys, values) = (&pool.keys[li], &pool.values[li]);
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
                let qd = select_rows(&q, &plan.decode_rows)?.reshape((b, kvh, group, hd))?.transpose(0, 1)?.contiguous()?;
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
            let attn = if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts, 0)? };
            let attn = match plan.order.as_ref() {
                Some(order) => attn.index_select(order, 0)?,
                None => attn,
            };
            let attn = if self.attn_width > heads * hd { attn.pad_with_zeros(1, 0, self.attn_width - heads * hd)? } else { attn };
            x = (x + layer.output(&attn)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let [gate, up] = super::matmuls(&h, [&layer.w_gate, &layer.w_up])?;
            let ff = super::product(&layer.w_down, &(candle_nn::ops::silu(&gate)? * up)?)?;
            x = (x + ff)?;
        }
        drop(pool);
        for s in segments.iter_mut() {
            s.cache.len += s.tokens.len();
        }
        let logits = self.head(&x, segments, outputs)?;
        // One read-back for the greedy rows' tokens, one for the rows whose logits are needed.
        let mut first = Vec::with_capacity(segments.len());
        let mut at = 0;
        for &o in outputs {
            first.push(at);
            at += o;
        }
        let greedy_rows: Vec<u32> = (0..segments.len()).filter(|&i| greedy.get(i) == Some(&true) && outputs[i] == 1).map(|i| first[i] as u32).collect();
        let full_rows: Vec<u32> = (0..at as u32).filter(|r| greedy_rows.binary_search(r).is_err()).collect();
        let tokens = match greedy_rows.is_empty() {
            true => Vec::new(),
            false => select_rows(&logits, &greedy_rows)?.argmax(D::Minus1)?.to_vec1::<u32>()?,
        };
        let mut full = match full_rows.is_empty() {
            true => Vec::new(),
            false => select_rows(&logits, &full_rows)?.to_dtype(DType::F32)?.to_vec2::<f32>()?,
        }
        .into_iter();
        let mut tokens = tokens.into_iter();
        Ok((0..segments.len())
            .map(|i| match greedy_rows.binary_search(&(first[i] as u32)) {
                Ok(_) => vec![StepLogits::Argmax(tokens.next().expect("one token per greedy row"))],
                Err(_) => full.by_ref().take(outputs[i]).map(StepLogits::Full).collect(),
            })
            .collect())
    }

    /// The step's attention tables (after its blocks are allocated; positions from each cache's current length).
    fn plan(&self, segments: &[Segment<'_>]) -> candle_core::Result<Plan> {
        let device = &self.device;
        let mut write = Vec::new();
        let mut decode_rows = Vec::new();
        let mut decode_seqs = Vec::new();
        let mut prefill = Vec::new();
        let mut at = 0;
        for s in segments {
            let blocks = s.cache.paged().expect("checked by forward_paged");
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

/// The index tensor for `scatter_set` along the slots of a `[kv_heads, slots, head_dim]` pool: `[kv_heads,
/// slots.len(), head_dim]`, each slot repeated across heads and values.
fn scatter_index(slots: Vec<u32>, kv_heads: usize, head_dim: usize, device: &Device) -> candle_core::Result<Tensor> {
    let n = slots.len();
    Tensor::from_vec(slots, (1, n, 1), device)?.broadcast_as((kv_heads, n, head_dim))?.contiguous()
}

/// Rows of a 2-D tensor: a narrow when they are a run, a gather otherwise.
fn select_rows(t: &Tensor, rows: &[u32]) -> candle_core::Result<Tensor> {
    let first = rows.first().copied().unwrap_or(0) as usize;
    if rows.iter().enumerate().all(|(i, &r)| r as usize == first + i) {
        return t.narrow(0, first, rows.len());
    }
    t.index_select(&Tensor::from_vec(rows.to_vec(), rows.len(), t.device())?, 0)
}
