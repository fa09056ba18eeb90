//! Tensor parallelism: one decoder over several ranks, each holding a slice of every layer (`runtime.tensor_parallel`).
//!
//! The split is Megatron's. Attention heads and feed-forward columns are divided among the ranks: the q, k and v
//! projections and the gate and up projections are split by output rows (each rank computes its own heads and
//! its own columns of the feed-forward state from the whole hidden state), and the output and down projections by
//! input columns, so each rank's product is a partial sum of the layer's output. One sum all-reduce after each
//! (two per layer, [`Communicator::all_reduce_sum`]) gives every rank the layer's whole output; norms, residual
//! adds, biases after the reduce and RoPE run on every rank alike, so every rank holds the same residual stream.
//!
//! - **Heads** ([`split_heads`]): with no more ranks than kv heads, each rank takes whole groups of query heads
//!   with their kv head (grouped-query attention stays grouped); the ranks differ by at most one group where the
//!   count does not divide (SmolLM2's 3 kv heads over 2 ranks: 1 and 2, with 3 and 6 query heads; the first rank,
//!   which also computes the logits, takes the smaller share). Nothing is padded and nothing is computed twice, at
//!   the price of an unequal share. With more ranks than kv heads, each
//!   rank takes part of one group's query heads and a copy of that group's kv head: kv heads are replicated, as
//!   vLLM does, and the KV cache holds each copy once per rank.
//! - **Feed-forward columns** ([`RankSlice::ffn`]): split as evenly as the weights' quantization blocks allow
//!   (the down projection is split along its blocks; a split inside a block is refused, never requantized).
//! - **Embeddings and the output projection**: the embedding table is replicated (a row lookup needs no
//!   communication and is 1-3 % of a large model's weights); the output projection and the logits are rank 0's
//!   alone, so no rank but the first holds it (untied) or computes it, and no logits are gathered. A vocabulary
//!   split (vLLM's `ParallelLMHead`) would divide its memory too, at one all-gather per step.
//!
//! The ranks are threads of one process on the CPU ([`LocalGroup`]: shared buffers, the sum taken in rank order,
//! so every rank gets the same bits). Each rank keeps its own KV cache for its own kv heads ([`TpAttention`]), with
//! the same block accounting everywhere, so the scheduler's blocks mean the same on every rank.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use candle_core::quantized::QTensor;
use candle_core::{DType, Tensor};

use super::attention::{Attention, AttentionModel, Backend, KvCache, Segment};
use super::decoder::{decoder_engine, tp_decoder_engine, DecoderSetup};
use super::models::llama::{Model, ModelInfo};
use super::models::{DecoderModel, StepLogits, StepModel};
use super::{Engine, EngineError, ModelError};
use crate::job::{ComputeDtype, CpuWeights};

/// How the ranks of a tensor-parallel model sum their partial results.
pub trait Communicator: Send + Sync {
    /// The ranks in the group.
    fn ranks(&self) -> usize;

    /// Replaces `values` with their sum over every rank. Every rank calls it with as many values, as often and in
    /// the same order; every rank gets the same sum. Fails, on every rank, once any rank has failed
    /// ([`Communicator::abort`]).
    fn all_reduce_sum(&self, rank: usize, values: &mut [f32]) -> Result<(), String>;

    /// Rank `rank` has failed: every rank waiting in, or later calling, [`Communicator::all_reduce_sum`] fails
    /// with `reason` instead of waiting for it forever.
    fn abort(&self, rank: usize, reason: &str);
}

/// Ranks as threads of one process: each all-reduce copies every rank's values into a shared slot; the last to
/// arrive sums them in rank order and every rank copies the one result out.
pub struct LocalGroup {
    ranks: usize,
    state: Mutex<GroupState>,
    done: Condvar,
}

struct GroupState {
    /// All-reduces completed.
    round: u64,
    arrived: usize,
    parts: Vec<Vec<f32>>,
    sum: Arc<Vec<f32>>,
    failed: Option<String>,
}

impl LocalGroup {
    pub fn new(ranks: usize) -> Arc<LocalGroup> {
        Arc::new(LocalGroup {
            ranks,
            state: Mutex::new(GroupState { round: 0, arrived: 0, parts: vec![Vec::new(); ranks], sum: Arc::new(Vec::new()), failed: None }),
            done: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, GroupState> {
        // A rank that panicked holding the lock left it between operations: the state is whole.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Communicator for LocalGroup {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn all_reduce_sum(&self, rank: usize, values: &mut [f32]) -> Result<(), String> {
        let mut state = self.lock();
        if let Some(why) = &state.failed {
            return Err(why.clone());
        }
        let slot = &mut state.parts[rank];
        slot.clear();
        slot.extend_from_slice(values);
        state.arrived += 1;
        if state.arrived == self.ranks {
            // In rank order: ((r0 + r1) + r2) + ...
            let mut sum = std::mem::take(&mut state.parts[0]);
            for part in &state.parts[1..] {
                if part.len() != sum.len() {
                    let why = format!("tensor-parallel ranks reduced {} and {} values in the same all-reduce (a bug)", sum.len(), part.len());
                    state.failed = Some(why.clone());
                    self.done.notify_all();
                    return Err(why);
                }
                sum.iter_mut().zip(part).for_each(|(s, &p)| *s += p);
            }
            values.copy_from_slice(&sum);
            state.parts[0] = Vec::with_capacity(sum.len());
            state.sum = Arc::new(sum);
            state.arrived = 0;
            state.round += 1;
            self.done.notify_all();
            return Ok(());
        }
        let round = state.round;
        // The round cannot advance twice without this rank: the next all-reduce needs it to arrive.
        while state.round == round && state.failed.is_none() {
            state = self.done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        if state.round == round {
            return Err(state.failed.clone().unwrap_or_default());
        }
        let sum = state.sum.clone();
        drop(state);
        values.copy_from_slice(&sum);
        Ok(())
    }

    fn abort(&self, rank: usize, reason: &str) {
        let mut state = self.lock();
        state.failed.get_or_insert_with(|| format!("tensor-parallel rank {rank} failed: {reason}"));
        self.done.notify_all();
    }
}

/// A group whose rank `rank` fails its `at`-th all-reduce (counting from 1), as a rank whose device failed
/// would: the tests' fault, and `NIGHTSHIFT_FAILPOINT_TP=RANK:CALL`'s (a failpoint for the job-level tests).
pub struct FailAt {
    inner: Arc<dyn Communicator>,
    rank: usize,
    at: usize,
    calls: std::sync::atomic::AtomicUsize,
}

impl FailAt {
    pub fn new(inner: Arc<dyn Communicator>, rank: usize, at: usize) -> FailAt {
        FailAt { inner, rank, at, calls: std::sync::atomic::AtomicUsize::new(0) }
    }

    /// The failpoint `NIGHTSHIFT_FAILPOINT_TP` names, if set: `RANK:CALL`.
    fn from_env(inner: Arc<dyn Communicator>) -> Arc<dyn Communicator> {
        let point = std::env::var("NIGHTSHIFT_FAILPOINT_TP").ok().and_then(|v| {
            let (rank, at) = v.split_once(':')?;
            Some((rank.parse().ok()?, at.parse().ok()?))
        });
        match point {
            Some((rank, at)) => {
                tracing::warn!(rank, at, "NIGHTSHIFT_FAILPOINT_TP is set: a tensor-parallel rank will fail on purpose");
                Arc::new(FailAt::new(inner, rank, at))
            }
            None => inner,
        }
    }
}

impl Communicator for FailAt {
    fn ranks(&self) -> usize {
        self.inner.ranks()
    }

    fn all_reduce_sum(&self, rank: usize, values: &mut [f32]) -> Result<(), String> {
        if rank == self.rank && self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == self.at {
            return Err(format!("all-reduce {} failed on purpose (a failpoint)", self.at));
        }
        self.inner.all_reduce_sum(rank, values)
    }

    fn abort(&self, rank: usize, reason: &str) {
        self.inner.abort(rank, reason)
    }
}

/// One rank of a tensor-parallel model: its index and its group's communicator.
#[derive(Clone)]
pub struct Rank {
    index: usize,
    comm: Arc<dyn Communicator>,
}

impl std::fmt::Debug for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rank({} of {})", self.index, self.comm.ranks())
    }
}

impl Rank {
    pub fn new(index: usize, comm: Arc<dyn Communicator>) -> Rank {
        Rank { index, comm }
    }

    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether this rank computes the output projection and the logits (the first).
    pub fn heads_output(&self) -> bool {
        self.index == 0
    }

    /// `values` summed over the ranks.
    pub fn all_reduce(&self, values: &mut [f32]) -> candle_core::Result<()> {
        self.comm.all_reduce_sum(self.index, values).map_err(candle_core::Error::Msg)
    }

    /// A tensor summed over the ranks: in f32 (partial sums of another dtype widened, the sum rounded back once).
    pub fn all_reduce_tensor(&self, x: Tensor) -> candle_core::Result<Tensor> {
        let (dtype, shape, device) = (x.dtype(), x.shape().clone(), x.device().clone());
        let mut values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        self.all_reduce(&mut values)?;
        Tensor::from_vec(values, shape, &device)?.to_dtype(dtype)
    }
}

/// What one rank holds of every layer: its query heads and kv heads (indices into the model's), and how the
/// feed-forward columns are divided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankSlice {
    pub rank: usize,
    pub ranks: usize,
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
}

/// The heads of every rank ([`crate::engine::parallel`]'s rules): whole groups of query heads with their kv head
/// where there are at least as many kv heads as ranks, parts of one group's query heads with a copy of its kv
/// head otherwise. Err: why `ranks` cannot split these heads.
pub fn split_heads(heads: usize, kv_heads: usize, ranks: usize) -> Result<Vec<RankSlice>, String> {
    if ranks == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(format!("{ranks} ranks over {heads} heads and {kv_heads} kv heads"));
    }
    if ranks > heads {
        return Err(format!("{ranks} ranks are more than the model's {heads} attention heads: each rank needs one at least"));
    }
    let group = heads / kv_heads;
    let slices = if ranks <= kv_heads {
        (0..ranks)
            .map(|r| {
                let kv = kv_heads * r / ranks..kv_heads * (r + 1) / ranks;
                RankSlice { rank: r, ranks, heads: kv.start * group..kv.end * group, kv_heads: kv }
            })
            .collect()
    } else {
        // Ranks to groups as evenly as possible; a group's query heads to its ranks likewise.
        let mut slices = Vec::with_capacity(ranks);
        for g in 0..kv_heads {
            let members = ranks * g / kv_heads..ranks * (g + 1) / kv_heads;
            let n = members.len();
            if n > group {
                return Err(format!("{ranks} ranks over {kv_heads} kv heads give one kv head's {group} query heads to {n} ranks: each rank needs one at least"));
            }
            for (i, rank) in members.enumerate() {
                let heads = g * group + group * i / n..g * group + group * (i + 1) / n;
                slices.push(RankSlice { rank, ranks, heads, kv_heads: g..g + 1 });
            }
        }
        slices
    };
    Ok(slices)
}

impl RankSlice {
    /// The whole model on one rank.
    pub fn whole(heads: usize, kv_heads: usize) -> RankSlice {
        RankSlice { rank: 0, ranks: 1, heads: 0..heads, kv_heads: 0..kv_heads }
    }

    /// This rank's columns of a feed-forward state `width` wide: an even share, its bounds on multiples of
    /// `align` (the quantization block of the matrices split along it) where the width allows one per rank, of 32
    /// otherwise.
    pub fn ffn(&self, width: usize) -> Range<usize> {
        let align = [256, 32, 1].into_iter().find(|&a| width.is_multiple_of(a) && width / a >= self.ranks).unwrap_or(1);
        let units = width / align;
        units * self.rank / self.ranks * align..units * (self.rank + 1) / self.ranks * align
    }

    /// Rows `[start, end)` of a matrix (its output features): each row's bytes are its own, so the slice is the
    /// stored weights, bit for bit.
    pub fn rows_q(t: &QTensor, rows: Range<usize>) -> candle_core::Result<QTensor> {
        let dims = t.shape().dims().to_vec();
        let [n, k] = dims[..] else { candle_core::bail!("a matrix of shape {dims:?}") };
        if rows.end > n || rows.is_empty() {
            candle_core::bail!("rows {rows:?} of a matrix of {n}");
        }
        let data = t.data()?;
        let row_bytes = data.len() / n;
        candle_core::quantized::ggml_file::qtensor_from_ggml(t.dtype(), &data[rows.start * row_bytes..rows.end * row_bytes], vec![rows.len(), k], &candle_core::Device::Cpu)
    }

    /// Columns `[start, end)` of a matrix (its input features), whole quantization blocks of every row; a bound
    /// inside a block is refused (the weights would have to be requantized).
    pub fn columns_q(t: &QTensor, columns: Range<usize>) -> candle_core::Result<QTensor> {
        let dims = t.shape().dims().to_vec();
        let [n, k] = dims[..] else { candle_core::bail!("a matrix of shape {dims:?}") };
        let block = t.dtype().block_size();
        if columns.end > k || columns.is_empty() {
            candle_core::bail!("columns {columns:?} of a matrix of {k}");
        }
        if !columns.start.is_multiple_of(block) || !columns.end.is_multiple_of(block) {
            candle_core::bail!(
                "tensor parallelism would split its {k} columns at {} and {}, inside the {} blocks of {block} (choose a runtime.tensor_parallel whose split falls on whole blocks)",
                columns.start,
                columns.end,
                format!("{:?}", t.dtype()).to_lowercase()
            );
        }
        let data = t.data()?;
        let row_bytes = data.len() / n;
        let per_block = row_bytes / (k / block);
        let (from, to) = (columns.start / block * per_block, columns.end / block * per_block);
        let mut out = Vec::with_capacity(n * (to - from));
        for row in data.chunks_exact(row_bytes) {
            out.extend_from_slice(&row[from..to]);
        }
        candle_core::quantized::ggml_file::qtensor_from_ggml(t.dtype(), &out, vec![n, columns.len()], &candle_core::Device::Cpu)
    }

    /// Rows `[start, end)` of a dense tensor (a matrix's, or a vector's values).
    pub fn rows_t(t: &Tensor, rows: Range<usize>) -> candle_core::Result<Tensor> {
        t.narrow(0, rows.start, rows.len())?.contiguous()
    }

    /// Columns `[start, end)` of a dense matrix.
    pub fn columns_t(t: &Tensor, columns: Range<usize>) -> candle_core::Result<Tensor> {
        t.narrow(1, columns.start, columns.len())?.contiguous()
    }

    /// One line for the load log.
    pub fn describe(&self, head_dim: usize, ffn: usize) -> String {
        format!(
            "tensor-parallel rank {} of {}: query heads {}..{}, kv heads {}..{}, attention width {}, feed-forward columns {:?}",
            self.rank,
            self.ranks,
            self.heads.start,
            self.heads.end,
            self.kv_heads.start,
            self.kv_heads.end,
            self.heads.len() * head_dim,
            self.ffn(ffn)
        )
    }
}

/// The caches of one sequence on every rank (each rank's kv heads).
pub struct TpCache<C> {
    ranks: Vec<C>,
}

impl<C: KvCache> KvCache for TpCache<C> {
    fn len(&self) -> usize {
        self.ranks[0].len()
    }

    fn blocks(&self) -> usize {
        self.ranks[0].blocks()
    }
}

/// Every rank's attention backend, each over its own heads and its own KV cache; the same blocks are taken and
/// released on every rank, so a sequence's blocks count the same everywhere.
pub struct TpAttention<B> {
    ranks: Vec<B>,
}

impl<B: Attention> TpAttention<B> {
    pub fn new(ranks: Vec<B>) -> TpAttention<B> {
        TpAttention { ranks }
    }
}

/// Each rank's segments: the same tokens, each rank's caches.
fn rank_segments<'s, C>(segments: &'s mut [Segment<'_, TpCache<C>>], ranks: usize) -> Vec<Vec<Segment<'s, C>>> {
    let mut out: Vec<Vec<Segment<'s, C>>> = (0..ranks).map(|_| Vec::with_capacity(segments.len())).collect();
    for s in segments.iter_mut() {
        let tokens: &'s [u32] = s.tokens;
        for (r, cache) in s.cache.ranks.iter_mut().enumerate() {
            out[r].push(Segment { tokens, cache });
        }
    }
    out
}

impl<B: Attention> Attention for TpAttention<B> {
    type Cache = TpCache<B::Cache>;
    type Step = Vec<B::Step>;
    type Block = Vec<B::Block>;

    fn new_cache(&self, capacity_tokens: usize) -> Self::Cache {
        TpCache { ranks: self.ranks.iter().map(|a| a.new_cache(capacity_tokens)).collect() }
    }

    fn fork(&self, cache: &Self::Cache) -> candle_core::Result<Self::Cache> {
        Ok(TpCache { ranks: self.ranks.iter().zip(&cache.ranks).map(|(a, c)| a.fork(c)).collect::<candle_core::Result<_>>()? })
    }

    fn share_block(&self, cache: &Self::Cache, index: usize) -> Option<Self::Block> {
        self.ranks.iter().zip(&cache.ranks).map(|(a, c)| a.share_block(c, index)).collect()
    }

    fn cache_from_blocks(&self, blocks: Vec<Self::Block>, capacity_tokens: usize) -> Self::Cache {
        let mut per_rank: Vec<Vec<B::Block>> = (0..self.ranks.len()).map(|_| Vec::with_capacity(blocks.len())).collect();
        for block in blocks {
            for (r, b) in block.into_iter().enumerate() {
                per_rank[r].push(b);
            }
        }
        TpCache { ranks: self.ranks.iter().zip(per_rank).map(|(a, b)| a.cache_from_blocks(b, capacity_tokens)).collect() }
    }

    fn release_before(&self, cache: &mut Self::Cache, blocks: usize) {
        for (a, c) in self.ranks.iter().zip(&mut cache.ranks) {
            a.release_before(c, blocks);
        }
    }

    /// Every rank's bytes of a block together: what a block costs the process.
    fn block_bytes(&self) -> usize {
        self.ranks.iter().map(Attention::block_bytes).sum()
    }

    fn begin(&self, segments: &mut [Segment<'_, Self::Cache>], positions: &[usize]) -> candle_core::Result<Self::Step> {
        let per_rank = rank_segments(segments, self.ranks.len());
        let mut steps = Vec::with_capacity(self.ranks.len());
        for (r, (a, mut segs)) in self.ranks.iter().zip(per_rank).enumerate() {
            match a.begin(&mut segs, positions) {
                Ok(step) => steps.push(step),
                // The same blocks are taken on every rank: the first fails alone or not at all.
                Err(e) if r == 0 => return Err(e),
                Err(e) => candle_core::bail!("tensor-parallel rank {r} could not make room the first rank made (a bug): {e}"),
            }
        }
        Ok(steps)
    }

    fn attend(&self, _step: &Self::Step, _layer: usize, _qkv: [Tensor; 3], _segments: &mut [Segment<'_, Self::Cache>]) -> candle_core::Result<Tensor> {
        candle_core::bail!("a tensor-parallel model attends on each rank's backend (a bug)")
    }

    fn advance(&self, segments: &mut [Segment<'_, Self::Cache>]) {
        for (a, mut segs) in self.ranks.iter().zip(rank_segments(segments, self.ranks.len())) {
            a.advance(&mut segs);
        }
    }

    fn device_argmax(&self) -> bool {
        self.ranks[0].device_argmax()
    }
}

/// A decoder over `N` ranks, each a model of the family holding its slice ([`RankSlice`]) and its [`Rank`].
pub struct TpModel<M> {
    ranks: Vec<M>,
    group: Arc<dyn Communicator>,
}

impl<M> TpModel<M> {
    /// The ranks' models, in rank order, and their group.
    pub fn new(ranks: Vec<M>, group: Arc<dyn Communicator>) -> TpModel<M> {
        TpModel { ranks, group }
    }

    pub fn ranks(&self) -> &[M] {
        &self.ranks
    }
}

impl<M: DecoderModel + Sync> DecoderModel for TpModel<M> {
    fn vocab_size(&self) -> usize {
        self.ranks[0].vocab_size()
    }

    fn context_length(&self) -> usize {
        self.ranks[0].context_length()
    }

    fn bind_to_thread(&self) -> candle_core::Result<()> {
        self.ranks[0].bind_to_thread()
    }

    /// Rank 0's counts: every rank routes every token alike (the router is replicated).
    fn take_routing(&self) -> Option<(Vec<u64>, f64)> {
        let first = self.ranks[0].take_routing();
        self.ranks[1..].iter().for_each(|m| drop(m.take_routing()));
        first
    }
}

/// Aborts the group when a rank's step ends without finishing (an error, or a panic unwinding through it), so
/// that no other rank waits for it forever.
struct AbortUnlessDone<'a> {
    comm: &'a dyn Communicator,
    rank: usize,
    done: bool,
}

impl Drop for AbortUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.comm.abort(self.rank, "its step ended early");
        }
    }
}

impl<M, B> StepModel<TpAttention<B>> for TpModel<M>
where
    M: StepModel<B> + Sync,
    B: Attention + Sync,
    B::Cache: Send,
{
    /// Every rank's forward pass at once, rank 0 on the calling thread; rank 0's outputs. The first error of a
    /// rank that failed on its own is the step's (the others then fail in their next all-reduce).
    fn forward_step_timed(
        &self,
        attention: &TpAttention<B>,
        segments: &mut [Segment<'_, TpCache<B::Cache>>],
        outputs: &[usize],
        greedy: &[bool],
    ) -> candle_core::Result<(Vec<Vec<StepLogits>>, std::time::Duration)> {
        let n = self.ranks.len();
        let per_rank = rank_segments(segments, n);
        let comm = &*self.group;
        let run = |r: usize, model: &M, backend: &B, mut segs: Vec<Segment<'_, B::Cache>>| {
            let mut guard = AbortUnlessDone { comm, rank: r, done: false };
            let result = model.forward_step_timed(backend, &mut segs, outputs, greedy);
            if let Err(e) = &result {
                comm.abort(r, &crate::engine::first_line(e));
            }
            guard.done = true;
            result
        };
        let mut results = std::thread::scope(|scope| {
            let mut work = self.ranks.iter().zip(&attention.ranks).zip(per_rank).enumerate();
            let ((first_model, first_backend), first_segs) = work.next().expect("a rank").1;
            let handles: Vec<_> = work.map(|(r, ((m, b), segs))| scope.spawn(move || run(r, m, b, segs))).collect();
            let mut results = vec![run(0, first_model, first_backend, first_segs)];
            for h in handles {
                results.push(h.join().unwrap_or_else(|_| Err(candle_core::Error::Msg("a tensor-parallel rank panicked".into()))));
            }
            results
        });
        // A rank's own error before the others' "rank r failed" echoes.
        let echo = |e: &candle_core::Error| e.to_string().contains("tensor-parallel rank") && e.to_string().contains("failed:");
        if let Some(i) = results.iter().position(|r| r.as_ref().is_err_and(|e| !echo(e))).or_else(|| results.iter().position(Result::is_err)) {
            return Err(results.swap_remove(i).err().expect("an error"));
        }
        results.swap_remove(0)
    }
}

/// A loaded decoder: whole, or split over tensor-parallel ranks (threads of this process, [`LocalGroup`]).
pub enum Decoder {
    Whole(Model),
    Split(TpModel<Model>),
}

/// What one rank holds: its heads, and the bytes of its weights, of one KV block and of a step's activations.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn_columns: usize,
    pub weights_bytes: usize,
    /// KV cache bytes of one block of [`crate::engine::KV_BLOCK_TOKENS`] positions on this rank, every layer.
    pub block_bytes: usize,
    /// An estimate of a step's activations at its most tokens ([`activation_bytes`]).
    pub activations_bytes: usize,
}

/// Whether a split's ranks, whose weights are loaded, can run in `available` bytes (the process's memory: the
/// ranks share it): their activations and one sequence's KV blocks (`one_sequence` bytes, every rank's). Err: what
/// `runtime.tensor_parallel`'s refusal says, with the numbers, per rank.
pub fn check_fits(ranks: &[RankMemory], one_sequence: usize, available: u64) -> Result<(), String> {
    let activations: usize = ranks.iter().map(|r| r.activations_bytes).sum();
    if (activations.saturating_add(one_sequence)) as u64 <= available {
        return Ok(());
    }
    let per_rank: Vec<String> = ranks.iter().map(|r| format!("rank {}: weights {} MiB, activations {} MiB", r.rank, r.weights_bytes >> 20, r.activations_bytes >> 20)).collect();
    Err(format!(
        "is {}, whose ranks need {} MiB of activations and {} MiB for one sequence's KV cache beside their weights, and {} MiB is available ({})",
        ranks.len(),
        activations >> 20,
        one_sequence >> 20,
        available >> 20,
        per_rank.join("; ")
    ))
}

/// An estimate of the activations one layer of a step of `tokens` tokens holds at once on a rank of this shape
/// (layers run one after another, so one layer's worth), and its logits (`logit_rows` rows, rank 0 only): the
/// residual stream, its norm, q, k and v, the attention output, the partial sum and its all-reduce copy, gate, up
/// and their product (per expert used, in a mixture), in the activations' dtype; the reduce and the logits in f32.
pub fn activation_bytes(config: &crate::engine::ModelConfig, dtype: DType, tokens: usize, logit_rows: usize) -> usize {
    let (hd, s) = (config.head_dim, dtype.size_in_bytes());
    let used = config.moe.as_ref().map_or(1, |m| m.used);
    let per_token = 3 * config.hidden_size + 2 * config.heads * hd + 2 * config.kv_heads * hd + 3 * config.ffn_size * used;
    tokens * (per_token * s + config.hidden_size * 4) + logit_rows * config.vocab_size * 4
}

impl Decoder {
    /// Loads the decoder at `path` over `ranks` ranks (1: whole), each rank's slice as [`Model::load_rank`]
    /// loads it. The [`ModelInfo`] is the whole model's.
    pub fn load(path: &std::path::Path, device: &candle_core::Device, weights: CpuWeights, dtype: ComputeDtype, ranks: usize) -> Result<(Decoder, ModelInfo), ModelError> {
        if ranks <= 1 {
            let (model, info) = Model::load_as(path, device, weights, dtype)?;
            return Ok((Decoder::Whole(model), info));
        }
        if !device.is_cpu() {
            return Err(ModelError::Metadata(format!("runtime.tensor_parallel = {ranks} splits a model over CPU threads only in this build (NCCL ranks on GPUs are planned); on GPUs use --data-parallel")));
        }
        let whole = crate::engine::models::llama::inspect(path)?;
        let slices = split_heads(whole.config.heads, whole.config.kv_heads, ranks)
            .map_err(|e| ModelError::Metadata(format!("runtime.tensor_parallel = {ranks} cannot split this model: {e}")))?;
        let group = FailAt::from_env(LocalGroup::new(ranks));
        let mut models = Vec::with_capacity(ranks);
        let mut info = None;
        for slice in &slices {
            // Ranks on one device keep one embedding table (the first rank's).
            let (model, i) = Model::load_rank(path, device, weights, dtype, slice, Rank::new(slice.rank, group.clone()), models.first())?;
            models.push(model);
            info.get_or_insert(i);
        }
        Ok((Decoder::Split(TpModel::new(models, group)), info.expect("at least one rank")))
    }

    /// The first rank's model (the whole one's): what the attention's choice, dtypes and the layout are read from.
    pub fn first(&self) -> &Model {
        match self {
            Decoder::Whole(m) => m,
            Decoder::Split(tp) => &tp.ranks[0],
        }
    }

    /// Ranks the model is split over (1 when whole).
    pub fn ranks(&self) -> usize {
        match self {
            Decoder::Whole(_) => 1,
            Decoder::Split(tp) => tp.ranks.len(),
        }
    }

    /// Each rank's heads, weights and KV block bytes on `backend` (its cache in `kv_dtype`), and the activations
    /// of a step of `tokens` tokens with `logit_rows` rows of logits.
    pub fn memory(&self, backend: Backend, kv_dtype: DType, tokens: usize, logit_rows: usize) -> Vec<RankMemory> {
        let one = |rank: usize, m: &Model| {
            let shape = m.attention_shape();
            RankMemory {
                rank,
                heads: shape.heads,
                kv_heads: shape.kv_heads,
                ffn_columns: m.config.ffn_size,
                weights_bytes: m.weight_bytes(),
                block_bytes: backend.block_bytes(m, kv_dtype),
                activations_bytes: activation_bytes(&m.config, m.dtype(), tokens, if rank == 0 { logit_rows } else { 0 }),
            }
        };
        match self {
            Decoder::Whole(m) => vec![one(0, m)],
            Decoder::Split(tp) => tp.ranks.iter().enumerate().map(|(r, m)| one(r, m)).collect(),
        }
    }

    /// Bytes of weights held, every rank's together.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Decoder::Whole(m) => m.weight_bytes(),
            Decoder::Split(tp) => tp.ranks.iter().map(Model::weight_bytes).sum(),
        }
    }

    /// KV cache bytes of one block, every rank's together (the ranks share this process's memory).
    pub fn block_bytes(&self, backend: Backend, kv_dtype: DType) -> usize {
        self.memory(backend, kv_dtype, 0, 0).iter().map(|r| r.block_bytes).sum()
    }

    /// The batch engine over this decoder.
    pub fn engine(self, setup: DecoderSetup) -> Result<Box<dyn Engine>, EngineError> {
        match self {
            Decoder::Whole(m) => decoder_engine(m, setup),
            Decoder::Split(tp) => tp_decoder_engine(tp, setup),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A split fits when every rank's activations and one sequence's KV blocks fit the memory left; otherwise the
    /// refusal names the split, the totals, the memory available and each rank's weights and activations.
    #[test]
    fn a_split_that_does_not_fit_is_refused_with_the_numbers() {
        let rank = |rank: usize, weights: usize, activations: usize| RankMemory { rank, heads: 2, kv_heads: 1, ffn_columns: 64, weights_bytes: weights << 20, block_bytes: 4096, activations_bytes: activations << 20 };
        let ranks = [rank(0, 300, 40), rank(1, 250, 24)];
        assert_eq!(check_fits(&ranks, 16 << 20, 80 << 20), Ok(()));
        let problem = check_fits(&ranks, 16 << 20, (80 << 20) - 1).unwrap_err();
        assert_eq!(
            problem,
            "is 2, whose ranks need 64 MiB of activations and 16 MiB for one sequence's KV cache beside their weights, and 79 MiB is available (rank 0: weights 300 MiB, activations 40 MiB; rank 1: weights 250 MiB, activations 24 MiB)"
        );
        assert!(check_fits(&ranks, usize::MAX, u64::MAX - 1).is_err(), "no overflow past the largest sizes");
    }

    #[test]
    fn heads_split_by_groups_or_replicate_kv_heads() {
        let heads = |s: &[RankSlice]| s.iter().map(|r| (r.heads.clone(), r.kv_heads.clone())).collect::<Vec<_>>();
        // SmolLM2: 9 heads, 3 kv heads.
        assert_eq!(heads(&split_heads(9, 3, 1).unwrap()), [(0..9, 0..3)]);
        assert_eq!(heads(&split_heads(9, 3, 2).unwrap()), [(0..3, 0..1), (3..9, 1..3)]);
        assert_eq!(heads(&split_heads(9, 3, 3).unwrap()), [(0..3, 0..1), (3..6, 1..2), (6..9, 2..3)]);
        // More ranks than kv heads: parts of a group each, its kv head replicated.
        assert_eq!(heads(&split_heads(9, 3, 4).unwrap()), [(0..3, 0..1), (3..6, 1..2), (6..7, 2..3), (7..9, 2..3)]);
        assert_eq!(heads(&split_heads(32, 8, 16).unwrap())[..3], [(0..2, 0..1), (2..4, 0..1), (4..6, 1..2)]);
        assert!(split_heads(9, 3, 10).is_err());
        assert!(split_heads(4, 2, 0).is_err());
        let every = split_heads(64, 8, 8).unwrap();
        assert!(every.iter().enumerate().all(|(r, s)| s.rank == r && s.heads.len() == 8 && s.kv_heads.len() == 1));
    }

    #[test]
    fn ffn_columns_fall_on_blocks_and_cover_the_width() {
        for (width, ranks) in [(1536, 2), (1536, 3), (8192, 3), (14336, 8), (96, 3), (100, 3)] {
            let slices: Vec<Range<usize>> = (0..ranks).map(|r| RankSlice { rank: r, ranks, heads: 0..1, kv_heads: 0..1 }.ffn(width)).collect();
            assert_eq!(slices[0].start, 0);
            assert_eq!(slices[ranks - 1].end, width);
            assert!(slices.windows(2).all(|w| w[0].end == w[1].start && !w[0].is_empty()), "{width} over {ranks}: {slices:?}");
            if width % 256 == 0 {
                assert!(slices.iter().all(|s| s.start % 256 == 0), "{slices:?}");
            }
        }
    }

    #[test]
    fn slices_of_quantized_matrices_are_their_blocks() {
        use candle_core::quantized::GgmlDType;
        let device = candle_core::Device::Cpu;
        let w = Tensor::from_vec((0..8 * 128).map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0).collect::<Vec<_>>(), (8, 128), &device).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let whole = q.dequantize(&device).unwrap();
        let cols = RankSlice::columns_q(&q, 32..96).unwrap().dequantize(&device).unwrap();
        let expect = whole.narrow(1, 32, 64).unwrap();
        assert_eq!(cols.flatten_all().unwrap().to_vec1::<f32>().unwrap(), expect.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let rows = RankSlice::rows_q(&q, 3..5).unwrap().dequantize(&device).unwrap();
        assert_eq!(rows.flatten_all().unwrap().to_vec1::<f32>().unwrap(), whole.narrow(0, 3, 2).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let err = RankSlice::columns_q(&q, 16..64).unwrap_err().to_string();
        assert!(err.contains("inside the q4_1 blocks of 32"), "{err}");
    }

    /// Every rank gets the same sum, in rank order; a failing rank wakes the others with its reason.
    #[test]
    fn local_group_sums_in_rank_order_and_fails_together() {
        let group = LocalGroup::new(3);
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|r| {
                    let g = group.clone();
                    s.spawn(move || {
                        let mut out = Vec::new();
                        for round in 0..50 {
                            let mut v = vec![r as f32 + round as f32 * 0.1, 1e8, -1e8 + r as f32];
                            g.all_reduce_sum(r, &mut v).unwrap();
                            out.extend(v);
                        }
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(sums.iter().all(|s| s == &sums[0]));
        let expect: f32 = (0.0f32 + 4.9) + (1.0 + 4.9) + (2.0 + 4.9);
        assert!((sums[0][147] - expect).abs() < 1e-4, "{}", sums[0][147]);
        let group = LocalGroup::new(2);
        let err = std::thread::scope(|s| {
            let g = group.clone();
            let waiting = s.spawn(move || g.all_reduce_sum(0, &mut [1.0]));
            std::thread::sleep(std::time::Duration::from_millis(20));
            group.abort(1, "out of memory");
            waiting.join().unwrap()
        });
        assert_eq!(err.unwrap_err(), "tensor-parallel rank 1 failed: out of memory");
        assert!(group.all_reduce_sum(1, &mut [1.0]).is_err(), "a failed group stays failed");
    }
}
