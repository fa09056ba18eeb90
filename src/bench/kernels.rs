//! `nightshift bench kernels`: the CPU kernels' throughput on a GGUF file's own matrices (one layer's, and the
//! output projection), at each instruction-set level this CPU has and a few row counts: where the time of a
//! forward pass goes, and what each level buys.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::quantized::gguf_file::Content;
use serde::Serialize;

use crate::engine::kernels::{Level, Packed};
use crate::engine::ModelError;
use crate::error::Error;

#[derive(Clone, Debug)]
pub struct KernelBenchOptions {
    pub model: PathBuf,
    /// Activation rows per product: 1 is a lone decode step, hundreds a prefill.
    pub rows: Vec<usize>,
    /// Levels to measure (default: every one this CPU has).
    pub levels: Vec<Level>,
    /// Cache lengths at which to measure a decode step's attention (none: not measured).
    pub contexts: Vec<usize>,
    /// Sequences in that decode step.
    pub seqs: usize,
    /// Positions at the start of every one of those sequences' caches held in common (the same blocks, as a prefix
    /// cache hit holds them); 0 for none.
    pub shared_prefix: usize,
    /// (cached positions, new tokens) of prefills whose attention to measure: one sequence's prefill chunk over a
    /// cached prefix.
    pub prefills: Vec<(usize, usize)>,
}

/// One step's attention, every layer: a decode step at one cache length (what it streams and how fast), or one
/// sequence's prefill over a cached prefix (how fast it computes).
#[derive(Clone, Debug, Serialize)]
pub struct AttentionMeasurement {
    /// `decode` or `prefill`.
    pub step: &'static str,
    pub kv_dtype: &'static str,
    pub level: &'static str,
    pub seqs: usize,
    /// Positions each sequence attends to (its cache and the new tokens).
    pub context: usize,
    /// Of those, the leading positions every sequence's cache holds in common (the same blocks).
    pub shared: usize,
    /// New tokens per sequence: 1 decoding, the chunk's length in a prefill.
    pub new_tokens: usize,
    /// Median seconds of the step's attention, every layer.
    pub seconds: f64,
    /// KV cache bytes the step attends to: a shared prefix's once per sequence, as if each held its own copy.
    pub bytes: u64,
    /// `bytes / seconds / 1e9`.
    pub gbps: f64,
    /// Multiply-adds of scores and of values, twice, over the seconds, in billions: `4 x heads x head_dim` per
    /// position each new token sees, every layer.
    pub gflops: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct KernelMeasurement {
    pub tensor: String,
    pub dtype: String,
    /// `[n, k]`.
    pub shape: [usize; 2],
    pub level: &'static str,
    pub rows: usize,
    /// Median seconds of one product.
    pub seconds: f64,
    /// `2 * rows * n * k / seconds / 1e9`.
    pub gflops: f64,
}

pub fn kernels(options: &KernelBenchOptions) -> Result<Vec<KernelMeasurement>, Error> {
    let path = &options.model;
    let fmt = |e: candle_core::Error| Error::Model(ModelError::Format { path: path.clone(), message: e.to_string() });
    let mut file = std::fs::File::open(path).map_err(|source| Error::Model(ModelError::Open { path: path.clone(), source }))?;
    let content = Content::read(&mut file).map_err(fmt)?;
    let mut names: Vec<String> = content.tensor_infos.keys().filter(|n| n.starts_with("blk.0.") && content.tensor_infos[*n].shape.dims().len() == 2).cloned().collect();
    names.sort();
    names.push(if content.tensor_infos.contains_key("output.weight") { "output.weight" } else { "token_embd.weight" }.to_string());
    let levels = if options.levels.is_empty() { Level::available() } else { options.levels.clone() };
    // As the engine's drive loop does: this thread runs products with the pool, not through it.
    crate::engine::device::join_cpu_pool();
    let mut out = Vec::new();
    for name in names {
        let t = content.tensor(&mut file, &name, &candle_core::Device::Cpu).map_err(fmt)?;
        let Some(packed) = Packed::from_qtensor(&t).map_err(fmt)? else { continue };
        let (n, k) = (packed.rows(), packed.columns());
        for &rows in &options.rows {
            let x: Vec<f32> = (0..rows * k).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            for &level in &levels {
                let seconds = median_seconds(0.02, 10_000, || packed.matmul_at(level, &x, rows));
                out.push(KernelMeasurement {
                    tensor: name.clone(),
                    dtype: format!("{:?}", packed.stored_dtype()).to_lowercase(),
                    shape: [n, k],
                    level: level.name(),
                    rows,
                    seconds,
                    gflops: 2.0 * (rows * n * k) as f64 / seconds / 1e9,
                });
            }
        }
    }
    Ok(out)
}

/// A decode step's attention on the host backend, every layer of the model's shape, for `seqs` sequences whose
/// caches hold `context - 1` positions (random keys and values, f32 and the 16-bit dtypes; the first
/// `shared_prefix` the same blocks in all of them): the bytes of the KV cache it attends to per second; and a prefill's over a cached prefix, for each of `prefills`: how fast it computes.
/// At each of the options' levels (the attention's code differs by level: AVX-512 at VNNI and AMX where the CPU has
/// it, AVX2, portable).
pub fn attention(options: &KernelBenchOptions) -> Result<Vec<AttentionMeasurement>, Error> {
    use candle_core::DType;

    use crate::engine::{Attention, HostAttention};

    if options.contexts.is_empty() && options.prefills.is_empty() {
        return Ok(Vec::new());
    }
    let config = crate::engine::models::llama::inspect(&options.model).map_err(Error::Model)?.config;
    crate::engine::device::join_cpu_pool();
    let row = config.kv_heads * config.head_dim;
    let noise = |n: usize, salt: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7919 + salt * 104_729) % 2001) as f32 / 1000.0 - 1.0).collect() };
    // Only levels this CPU runs: the attention's code for a level uses its instructions.
    let levels: Vec<Level> = Level::available().into_iter().filter(|l| options.levels.is_empty() || options.levels.contains(l)).collect();
    let mut out = Vec::new();
    for &level in &levels {
        for dtype in [DType::F32, DType::F16] {
            let host = HostAttention::for_shape(config.attention_shape(config.heads * config.head_dim), dtype);
            let tiled = HostAttention::for_shape(config.attention_shape(config.heads * config.head_dim), dtype).with_tiles(true);
            for &context in &options.contexts {
                let context = context.clamp(1, config.context_length);
                // Sequences sharing a prefix hold the same keys and values for it, in the same blocks.
                let shared = options.shared_prefix.min(context - 1);
                let prefix = host.prefix_cache(&noise(shared * row, 1), &noise(shared * row, 2), shared);
                let own = |s: usize, salt: usize| [&noise(shared * row, salt)[..], &noise(context * row, 2 * s + 3 + salt)[shared * row..]].concat();
                let mut caches: Vec<_> = (0..options.seqs).map(|s| host.extended_cache(&prefix, &own(s, 1), &own(s, 2), context)).collect();
                let q = noise(options.seqs * config.heads * config.head_dim, 7);
                let seconds = median_seconds(0.05, 1000, || host.decode_attention(level, &mut caches, &q));
                // Every layer reads each sequence's keys and values for its `context` positions, in whole blocks.
                let blocks = context.div_ceil(crate::engine::KV_BLOCK_TOKENS) as u64;
                let bytes = options.seqs as u64 * blocks * host.block_bytes() as u64;
                let flops = 4.0 * (config.layers * config.heads * config.head_dim * options.seqs * context) as f64;
                out.push(AttentionMeasurement {
                    step: "decode",
                    kv_dtype: if dtype == DType::F32 { "f32" } else { "f16" },
                    level: level.name(),
                    seqs: options.seqs,
                    context,
                    shared,
                    new_tokens: 1,
                    seconds,
                    bytes,
                    gbps: bytes as f64 / seconds / 1e9,
                    gflops: flops / seconds / 1e9,
                });
            }
            // At the AMX level, prefills also as `runtime.attention = "host-amx"` runs them (the tile unit's split
            // bf16 products), where they run.
            let tiles = level == Level::Amx && crate::engine::attention::host::tiles_available(config.head_dim);
            let runs: Vec<(&HostAttention, &'static str)> = if tiles { vec![(&host, level.name()), (&tiled, "host-amx")] } else { vec![(&host, level.name())] };
            for (&(cached, new), &(host, label)) in options.prefills.iter().flat_map(|p| runs.iter().map(move |r| (p, r))) {
                let new = new.clamp(1, config.context_length);
                let cached = cached.min(config.context_length - new);
                let context = cached + new;
                let mut cache = host.prefilled_cache(&noise(context * row, 1), &noise(context * row, 2), cached, new);
                let q = noise(new * config.heads * config.head_dim, 7);
                let seconds = median_seconds(0.05, 1000, || host.prefill_attention(level, &mut cache, &q, new));
                let blocks = context.div_ceil(crate::engine::KV_BLOCK_TOKENS) as u64;
                let bytes = blocks * host.block_bytes() as u64;
                // New token i sees `cached + i + 1` positions.
                let seen = (cached * new + new * (new + 1) / 2) as f64;
                let flops = 4.0 * (config.layers * config.heads * config.head_dim) as f64 * seen;
                out.push(AttentionMeasurement {
                    step: "prefill",
                    kv_dtype: if dtype == DType::F32 { "f32" } else { "f16" },
                    level: label,
                    seqs: 1,
                    context,
                    shared: cached,
                    new_tokens: new,
                    seconds,
                    bytes,
                    gbps: bytes as f64 / seconds / 1e9,
                    gflops: flops / seconds / 1e9,
                });
            }
        }
    }
    Ok(out)
}

/// Seconds one call of `f` takes: repeated until a sample takes `sample_s` (at most `max_reps` times), after a
/// warm-up; the median of five samples.
fn median_seconds<T>(sample_s: f64, max_reps: usize, mut f: impl FnMut() -> T) -> f64 {
    std::hint::black_box(f());
    let once = Instant::now();
    std::hint::black_box(f());
    let reps = ((sample_s / once.elapsed().as_secs_f64().max(1e-7)) as usize).clamp(1, max_reps);
    let mut samples: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                std::hint::black_box(f());
            }
            t.elapsed().as_secs_f64() / reps as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[2]
}
