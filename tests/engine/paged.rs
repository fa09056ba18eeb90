//! The paged attention backend (the one accelerators run: KV cache in a device pool, attention in tensor ops,
//! greedy tokens chosen on the device) against the host backend, on the CPU, through the model's one layer loop:
//! the same logits within f32 rounding, on the real SmolLM2 GGUF and on every Hugging Face variant; the same
//! results batched as alone; forks, the pool's accounting and its limits; bf16 within a stated tolerance.

use std::path::Path;

use candle_core::{DType, Device};
use nightshift::engine::attention::PagedKernel;
use nightshift::engine::{Attention, Backend, HostAttention, KvCache, Model, PagedAttention, Segment, StepLogits, StepModel};

use super::hf_variants;
use crate::support::*;

pub(super) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub(super) fn largest(a: &[f32]) -> f32 {
    a.iter().fold(0f32, |m, x| m.max(x.abs()))
}

fn argmax(v: &[f32]) -> u32 {
    nightshift::engine::sampling::argmax(v)
}

/// Prompts of different lengths (ids valid in every test model's vocabulary), one crossing a KV block boundary.
pub(super) const PROMPTS: [&[u32]; 3] = [
    &[104, 101, 108, 108, 111],
    &[72, 105, 33, 32, 116, 104, 101, 32, 101, 110, 100, 32, 111, 102, 32, 116, 104, 101, 32, 108, 105, 110, 101],
    &[87, 104, 121, 63],
];

/// The logits after the last token of each segment, through any decoder's forward pass (a whole model's, a
/// tensor-parallel one's).
pub(super) fn forward<A: Attention, M: StepModel<A>>(model: &M, attention: &A, segments: &mut [Segment<'_, A::Cache>]) -> Vec<Vec<f32>> {
    let outputs = vec![1; segments.len()];
    let (rows, _) = model.forward_step_timed(attention, segments, &outputs, &[]).unwrap();
    rows.into_iter()
        .map(|mut r| match r.remove(0) {
            StepLogits::Full(l) => l,
            StepLogits::Argmax(_) => unreachable!("no greedy rows were asked for"),
        })
        .collect()
}

/// Runs the three prompts through `model`: the first prefilled alone, then the other two prefilled in one pass
/// beside the first's first decode step, then `steps` greedy decode steps of all three together. Returns the logits
/// of every sequence at every step, in order, and the caches. `tokens`: the tokens to feed (from a reference run);
/// `None` feeds this run's own argmax.
pub(super) fn scenario<A: Attention, M: StepModel<A>>((model, attention): (&M, &A), steps: usize, tokens: Option<&[Vec<u32>]>) -> (Vec<Vec<Vec<f32>>>, Vec<A::Cache>) {
    let mut caches: Vec<A::Cache> = (0..3).map(|_| attention.new_cache(8)).collect();
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
    let first = forward(model, attention, &mut [Segment { tokens: PROMPTS[0], cache: &mut caches[0] }]).remove(0);
    logits[0].push(first);
    let pick = |logits: &[Vec<Vec<f32>>], i: usize| -> u32 {
        let k = logits[i].len() - 1;
        match tokens {
            Some(t) => t[i][k],
            None => argmax(&logits[i][k]),
        }
    };
    let next0 = [pick(&logits, 0)];
    {
        let (c0, rest) = caches.split_at_mut(1);
        let (c1, c2) = rest.split_at_mut(1);
        let out = forward(model, attention, &mut [
            Segment { tokens: &next0, cache: &mut c0[0] },
            Segment { tokens: PROMPTS[1], cache: &mut c1[0] },
            Segment { tokens: PROMPTS[2], cache: &mut c2[0] },
        ]);
        for (i, l) in out.into_iter().enumerate() {
            logits[i].push(l);
        }
    }
    for _ in 0..steps {
        let next: Vec<[u32; 1]> = (0..3).map(|i| [pick(&logits, i)]).collect();
        let mut segments: Vec<Segment<'_, A::Cache>> = next.iter().zip(&mut caches).map(|(t, cache)| Segment { tokens: t, cache }).collect();
        for (i, l) in forward(model, attention, &mut segments).into_iter().enumerate() {
            logits[i].push(l);
        }
    }
    (logits, caches)
}

/// The tokens a run fed: each step's argmax.
pub(super) fn fed(logits: &[Vec<Vec<f32>>]) -> Vec<Vec<u32>> {
    logits.iter().map(|steps| steps.iter().map(|l| argmax(l)).collect()).collect()
}

/// The paged path against the CPU path on one model, fed the CPU path's tokens: the largest logit difference
/// over every step and sequence, relative to the largest |logit|.
fn paged_against_cpu(cpu: &Host, paged: &Paged, steps: usize) -> f32 {
    let (reference, _) = scenario(cpu.pair(), steps, None);
    let tokens = fed(&reference);
    let (ours, caches) = scenario(paged.pair(), steps, Some(&tokens));
    let (mut worst, mut scale) = (0f32, 0f32);
    for (a, b) in reference.iter().flatten().zip(ours.iter().flatten()) {
        worst = worst.max(max_abs_diff(a, b));
        scale = scale.max(largest(a));
    }
    for (i, cache) in caches.iter().enumerate() {
        assert_eq!(cache.len(), PROMPTS[i].len() + reference[i].len() - 1, "sequence {i}'s length");
        assert_eq!(cache.blocks(), cache.len().div_ceil(nightshift::engine::KV_BLOCK_TOKENS), "sequence {i} holds a block per 16 positions");
    }
    worst / scale
}

/// A model with its attention backend.
struct WithBackend<A> {
    model: Model,
    attention: A,
}

impl<A> WithBackend<A> {
    fn pair(&self) -> (&Model, &A) {
        (&self.model, &self.attention)
    }
}

type Host = WithBackend<HostAttention>;
type Paged = WithBackend<PagedAttention>;

/// The paged pool's size when a test does not say: enough for every scenario here.
const POOL_BLOCKS: usize = 256;

fn host(model: Model) -> Host {
    WithBackend { attention: HostAttention::new(&model, DType::F32).unwrap(), model }
}

fn paged(model: Model, blocks: usize) -> Paged {
    WithBackend { attention: PagedAttention::new(&model, blocks).unwrap(), model }
}

/// The same weights twice: on the host backend and on the paged one.
fn load_pair(path: &Path) -> (Host, Paged) {
    load_pair_with(path, POOL_BLOCKS)
}

/// [`load_pair`] with a pool of `blocks` blocks.
fn load_pair_with(path: &Path, blocks: usize) -> (Host, Paged) {
    let (cpu, _) = Model::load(path, &Device::Cpu).unwrap();
    let (other, _) = Model::load(path, &Device::Cpu).unwrap();
    assert_eq!(Backend::for_model(&cpu), Backend::Host, "an f32 model on the CPU runs the host backend");
    (host(cpu), paged(other, blocks))
}

/// On the real SmolLM2 GGUF the two paths cannot agree to f32 rounding: candle's quantized kernels quantize
/// each matmul's input to 8 bits per block scaled by the block's largest value, and SmolLM2's hidden states have
/// outliers hundreds of times the typical value, so an ulp of difference in an attention sum (the paths add in
/// another order) can move a value a whole quantization step. (Each path alone is bit-exact run to run and, on
/// the CPU path, batched or alone.) So: the greedy tokens of the teacher-forced steps mostly agree, and the
/// logits stay within a bound that a wrong attention (a mask off by one, a misplaced head) breaks by far.
/// Measured: 61 of 64 argmaxes agree, largest difference 8.6 % of the largest logit.
#[test]
fn paged_path_tracks_the_cpu_path_on_quantized_smollm2() {
    let (cpu, paged) = load_pair(&model_path());
    let (reference, _) = scenario(cpu.pair(), 20, None);
    let tokens = fed(&reference);
    let (ours, _) = scenario(paged.pair(), 20, Some(&tokens));
    let (mut worst, mut scale, mut agree, mut total) = (0f32, 0f32, 0, 0);
    for (a, b) in reference.iter().flatten().zip(ours.iter().flatten()) {
        worst = worst.max(max_abs_diff(a, b));
        scale = scale.max(largest(a));
        agree += usize::from(argmax(a) == argmax(b));
        total += 1;
    }
    let rel = worst / scale;
    eprintln!("smollm2 gguf: paged vs cpu path, {agree} of {total} argmaxes agree, largest difference {rel:e} of the largest logit");
    assert!(agree * 10 >= total * 9, "only {agree} of {total} greedy tokens agree");
    assert!(rel <= 0.2, "the paged path's logits differ by {rel} of the largest logit");
}

/// Both paged kernels: the tiles, and the decode kernel's reference (the CUDA kernel's step plan: its block
/// tables, lengths and the decodes' rows placed before the prefills' in the mixed step). Measured: at most 5.6e-7
/// of the largest logit (f32 sums in another order).
#[test]
fn paged_path_equals_the_cpu_path_on_every_hf_variant() {
    for (variant, dir) in hf_variants("paged") {
        let (cpu, paged) = load_pair(&dir);
        let rel = paged_against_cpu(&cpu, &paged, 12);
        eprintln!("{variant}: paged (tiles) vs cpu path, largest difference {rel:e} of the largest logit");
        assert!(rel <= 1e-5, "{variant}: the paged path's logits differ by {rel} of the largest logit");
        let decode = with_decode_kernel(paged.model);
        let rel = paged_against_cpu(&cpu, &decode, 12);
        eprintln!("{variant}: paged (decode kernel) vs cpu path, largest difference {rel:e} of the largest logit");
        assert!(rel <= 1e-5, "{variant}: the decode kernel's logits differ by {rel} of the largest logit");
    }
}

/// The paged backend with the decode kernel for decodes (on the CPU, its reference).
fn with_decode_kernel(model: Model) -> Paged {
    WithBackend { attention: PagedAttention::with_kernel(&model, POOL_BLOCKS, PagedKernel::Decode).unwrap(), model }
}

/// Gemma 2 and 3 (post-norms, GeGLU, soft-caps, sliding windows of 16 positions crossed by the longer prompt's
/// decode steps, Gemma 3's local RoPE tables) on the paged path as on the host one, F32 weights.
#[test]
fn paged_path_equals_the_cpu_path_on_gemma_and_experts() {
    let dir = scratch("paged-gemma");
    let moe = |f: nightshift::synth::Family| matches!(f, nightshift::synth::Family::Mixtral | nightshift::synth::Family::Qwen3Moe | nightshift::synth::Family::Qwen2Moe | nightshift::synth::Family::Olmoe);
    for (family, head_dim, tied) in super::llama_cpp::FAMILIES.into_iter().filter(|f| f.0.is_gemma() || moe(f.0)) {
        let path = dir.join(format!("{family:?}.gguf"));
        let spec = super::llama_cpp::spec(family, head_dim, tied, super::llama_cpp::rope_theta(family));
        nightshift::synth::write_gguf(&path, &spec, candle_core::quantized::GgmlDType::F32).unwrap();
        let (cpu, paged) = load_pair(&path);
        let rel = paged_against_cpu(&cpu, &paged, 12);
        eprintln!("{family:?}: paged (tiles) vs cpu path, largest difference {rel:e} of the largest logit");
        assert!(rel <= 1e-5, "{family:?}: the paged path's logits differ by {rel} of the largest logit");
        let rel = paged_against_cpu(&cpu, &with_decode_kernel(paged.model), 12);
        eprintln!("{family:?}: paged (decode kernel) vs cpu path, largest difference {rel:e} of the largest logit");
        assert!(rel <= 1e-5, "{family:?}: the decode kernel's logits differ by {rel} of the largest logit");
    }
}

/// Each sequence alone through the paged path gives what it gives in the batch (masks and gathers keep
/// sequences apart), on every Hugging Face variant (f32: dense kernels, no activation quantization). Measured: at
/// most 3.7e-7 of the largest logit.
#[test]
fn paged_batched_equals_paged_alone() {
    for (variant, dir) in hf_variants("paged-alone") {
        let (_, paged) = load_pair(&dir);
        let (batched, _) = scenario(paged.pair(), 10, None);
        let tokens = fed(&batched);
        let mut worst = 0f32;
        let (model, attention) = paged.pair();
        for i in 0..3 {
            let mut cache = attention.new_cache(8);
            let prompt = model.forward(attention, &mut [Segment { tokens: PROMPTS[i], cache: &mut cache }]).unwrap().remove(0);
            let mut alone = vec![prompt];
            for &t in &tokens[i][..tokens[i].len() - 1] {
                alone.push(model.forward(attention, &mut [Segment { tokens: &[t], cache: &mut cache }]).unwrap().remove(0));
            }
            assert_eq!(alone.len(), batched[i].len());
            for (a, b) in alone.iter().zip(&batched[i]) {
                assert_eq!(argmax(a), argmax(b), "{variant}: sequence {i} picks another token alone");
                worst = worst.max(max_abs_diff(a, b) / largest(a));
            }
        }
        eprintln!("{variant}: paged batched vs alone, {worst:e} of the largest logit");
        assert!(worst <= 1e-5, "{variant}: batching changed a logit by {worst} of the largest");
    }
}

/// Long prompts on the tiles (bounded memory: query tiles of 128, key tiles of 512, an online softmax) give the
/// host backend's logits: three prefills in one step (8,000, 700 and 130 tokens: 71 query tiles, split in two
/// chunks on this model, the longest walking 16 key tiles), then three steps decoding all three at lengths past
/// key tile boundaries, a step of one decode beside a 600-token prefill, on a model with an 8,192-position context.
/// Measured: at most 3.4e-7 of the largest logit.
#[test]
fn long_prompts_in_tiles_give_the_cpu_paths_logits() {
    let dir = scratch("paged-long").join("model");
    write_long_context_model(&dir);
    let (cpu, paged) = load_pair_with(&dir, 12_000 / nightshift::engine::KV_BLOCK_TOKENS);
    let prompt = |n: usize, seed: usize| -> Vec<u32> { (0..n).map(|i| ((i * 7919 + seed * 104729) % 251) as u32 + 3).collect() };
    let prompts = [prompt(8000, 1), prompt(700, 2), prompt(130, 3)];
    let late = prompt(600, 4);
    let run = |(model, attention): (&Model, &dyn DynAttention)| -> Vec<Vec<f32>> { attention.run(model, &prompts, &late) };
    let reference = run((&cpu.model, &cpu.attention));
    let ours = run((&paged.model, &paged.attention));
    assert_eq!(reference.len(), ours.len());
    let (mut worst, mut scale) = (0f32, 0f32);
    for (a, b) in reference.iter().zip(&ours) {
        worst = worst.max(max_abs_diff(a, b));
        scale = scale.max(largest(a));
        assert_eq!(argmax(a), argmax(b));
    }
    let rel = worst / scale;
    eprintln!("long prompts: tiled paged vs cpu path, largest difference {rel:e} of the largest logit");
    assert!(rel <= 1e-5, "the tiles' logits differ by {rel} of the largest logit");
}

/// The long-prompt scenario on either backend, through a trait object (each backend's cache type is its own).
trait DynAttention {
    /// Prefills `prompts` in one step, decodes all of them for three steps (each feeding its own argmax), then a
    /// fourth step decodes the first beside a prefill of `late`; every output's logits, in order.
    fn run(&self, model: &Model, prompts: &[Vec<u32>; 3], late: &[u32]) -> Vec<Vec<f32>>;
}

impl<A: Attention> DynAttention for A {
    fn run(&self, model: &Model, prompts: &[Vec<u32>; 3], late: &[u32]) -> Vec<Vec<f32>> {
        let mut caches: Vec<A::Cache> = (0..3).map(|_| self.new_cache(8192)).collect();
        let mut out = Vec::new();
        let mut segments: Vec<Segment<'_, A::Cache>> = prompts.iter().zip(&mut caches).map(|(p, cache)| Segment { tokens: p, cache }).collect();
        let mut last = model.forward(self, &mut segments).unwrap();
        out.extend(last.iter().cloned());
        for _ in 0..3 {
            let next: Vec<[u32; 1]> = last.iter().map(|l| [argmax(l)]).collect();
            let mut segments: Vec<Segment<'_, A::Cache>> = next.iter().zip(&mut caches).map(|(t, cache)| Segment { tokens: t, cache }).collect();
            last = model.forward(self, &mut segments).unwrap();
            out.extend(last.iter().cloned());
        }
        let next = [argmax(&last[0])];
        let mut fourth = self.new_cache(8192);
        let mut segments = vec![Segment { tokens: &next[..], cache: &mut caches[0] }, Segment { tokens: late, cache: &mut fourth }];
        out.extend(model.forward(self, &mut segments).unwrap());
        out
    }
}

/// The engine's step: greedy rows come back as the device's argmax, the others as logits, in order.
#[test]
fn greedy_rows_come_back_as_the_argmax() {
    let (cpu, paged) = load_pair(&model_path());
    let (model, attention) = paged.pair();
    let mut caches: Vec<_> = (0..3).map(|_| attention.new_cache(8)).collect();
    let mut segments: Vec<Segment<'_, _>> = PROMPTS.iter().zip(&mut caches).map(|(p, cache)| Segment { tokens: p, cache }).collect();
    let rows = model.forward_step(attention, &mut segments, &[1, 2, 1], &[true, false, true]).unwrap();
    let mut again: Vec<_> = (0..3).map(|_| attention.new_cache(8)).collect();
    let mut segments: Vec<Segment<'_, _>> = PROMPTS.iter().zip(&mut again).map(|(p, cache)| Segment { tokens: p, cache }).collect();
    let full = model.forward_outputs(attention, &mut segments, &[1, 2, 1]).unwrap();
    assert_eq!(rows[0], vec![StepLogits::Argmax(argmax(&full[0][0]))]);
    assert_eq!(rows[1], full[1].iter().cloned().map(StepLogits::Full).collect::<Vec<_>>(), "a row with two outputs comes back whole");
    assert_eq!(rows[2], vec![StepLogits::Argmax(argmax(&full[2][0]))]);
    // The host backend returns logits whatever is asked.
    let (model, attention) = cpu.pair();
    let mut cache = attention.new_cache(8);
    let rows = model.forward_step(attention, &mut [Segment { tokens: PROMPTS[0], cache: &mut cache }], &[1], &[true]).unwrap();
    assert!(matches!(&rows[0][0], StepLogits::Full(l) if argmax(l) == argmax(&full[0][0])));
}

/// A fork holds its own copy: both continue as the original would; blocks go back to the pool when caches drop;
/// a step the pool cannot hold is an error that leaves the cache as it was. (A cache of one backend cannot reach
/// the other: each backend's forward pass takes only its own cache type.)
/// Forks share their blocks; the first write into a shared block copies it, from the pool's free blocks, and a
/// step that needs a copy the pool cannot hold fails, leaving the cache as it was.
#[test]
fn forks_share_blocks_and_copy_on_write_within_the_pool() {
    let (model, _) = Model::load(&model_path(), &Device::Cpu).unwrap();
    let paged = paged(model, 4);
    let (model, attention) = paged.pair();
    let mut cache = attention.new_cache(8);
    let prompt = model.forward(attention, &mut [Segment { tokens: PROMPTS[1], cache: &mut cache }]).unwrap().remove(0);
    assert_eq!(cache.blocks(), 2);
    let mut fork = attention.fork(&cache).unwrap();
    assert_eq!((fork.len(), fork.blocks()), (cache.len(), 2));
    // The original copies the shared partly filled block (3 of 4 blocks in use); the fork then holds the old one alone.
    let next = [argmax(&prompt)];
    let a = model.forward(attention, &mut [Segment { tokens: &next, cache: &mut cache }]).unwrap().remove(0);
    let b = model.forward(attention, &mut [Segment { tokens: &next, cache: &mut fork }]).unwrap().remove(0);
    assert_eq!(max_abs_diff(&a, &b), 0.0, "a fork continues exactly as its original");
    // One block is left: a third sequence takes it, a fourth cannot start and its cache stays empty.
    let mut third = attention.new_cache(8);
    model.forward(attention, &mut [Segment { tokens: PROMPTS[0], cache: &mut third }]).unwrap();
    let mut fourth = attention.new_cache(8);
    let err = model.forward(attention, &mut [Segment { tokens: PROMPTS[2], cache: &mut fourth }]).unwrap_err().to_string();
    assert!(err.contains("free blocks"), "{err}");
    assert!(fourth.is_empty() && fourth.blocks() == 0);
    // A fork of the third needs a copy of its partly filled block to write: none is free.
    let mut third_fork = attention.fork(&third).unwrap();
    let one = [PROMPTS[0][0]];
    assert!(model.forward(attention, &mut [Segment { tokens: &one, cache: &mut third_fork }]).is_err());
    assert_eq!((third_fork.len(), third_fork.blocks()), (PROMPTS[0].len(), 1));
    // Dropping the fork of the first frees the block it held alone (the other is still the original's).
    drop(fork);
    let with_copy = model.forward(attention, &mut [Segment { tokens: &one, cache: &mut third_fork }]).unwrap().remove(0);
    // The pool is full again, but the third now holds its block alone: its write needs no copy.
    let again = model.forward(attention, &mut [Segment { tokens: &one, cache: &mut third }]).unwrap().remove(0);
    assert_eq!(max_abs_diff(&with_copy, &again), 0.0, "the copy and the original continue alike");
}

/// The prefix cache on the paged pool: a prompt whose first blocks are another sequence's (shared, not copied)
/// gives a full prefill's next-token logits within f32 rounding (the pool's products are candle's, whose sums may
/// be ordered by the pass's row count) and its argmax; the shared blocks outlive their writer, and every block is
/// free again once nothing holds it.
#[test]
fn a_cached_prefix_on_the_paged_pool_gives_a_full_prefills_logits() {
    let (model, _) = Model::load(&model_path(), &Device::Cpu).unwrap();
    let paged = paged(model, 8);
    let (model, attention) = paged.pair();
    let instruction: Vec<u32> = PROMPTS[1].iter().chain(PROMPTS[1]).copied().take(32).collect();
    let with = |tail: &[u32]| -> Vec<u32> { instruction.iter().chain(tail).copied().collect() };
    let (p, q) = (with(PROMPTS[0]), with(PROMPTS[2]));
    let mut full = attention.new_cache(64);
    let expected = model.forward(attention, &mut [Segment { tokens: &p, cache: &mut full }]).unwrap().remove(0);
    drop(full);
    let mut writer = attention.new_cache(64);
    model.forward(attention, &mut [Segment { tokens: &q, cache: &mut writer }]).unwrap();
    let shared: Vec<_> = (0..2).map(|i| attention.share_block(&writer, i).expect("a full block")).collect();
    let mut reader = attention.cache_from_blocks(shared.clone(), 64);
    drop(writer);
    let cached = model.forward(attention, &mut [Segment { tokens: PROMPTS[0], cache: &mut reader }]).unwrap().remove(0);
    let diff = max_abs_diff(&cached, &expected);
    assert!(diff <= 1e-4 * largest(&expected).max(1.0), "a cached prefix changes the logits by {diff}");
    assert_eq!(argmax(&cached), argmax(&expected));
    // Held by the reader and the handles: 3 blocks in use. Once all let go, 8 free blocks hold 128 positions.
    drop((reader, shared));
    let mut big = attention.new_cache(128);
    let long: Vec<u32> = (0..128).map(|i| PROMPTS[1][i % PROMPTS[1].len()]).collect();
    model.forward(attention, &mut [Segment { tokens: &long, cache: &mut big }]).unwrap();
    assert_eq!(big.blocks(), 8);
}

/// A tiny Phi-3 whose every layer slides over `window` positions (Hugging Face safetensors, f32).
pub(super) fn write_windowed_phi3(dir: &Path, window: usize) {
    write_tiny_hf_model(dir, crate::support::HfVariant::Phi3);
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["sliding_window"] = window.into();
    std::fs::write(&path, config.to_string()).unwrap();
}

/// The three prompts prefilled together, then `steps` decode steps of all three, each sequence giving back the
/// blocks wholly before its next query's window first when `window` is given (as the engine does when the scheduler
/// says so): every step's logits, and the most blocks the caches held at once. `tokens`: what to feed (else each
/// step's argmax).
fn run_releasing<A: Attention, M: StepModel<A>>((model, attention): (&M, &A), steps: usize, window: Option<usize>, tokens: Option<&[Vec<u32>]>) -> candle_core::Result<(Vec<Vec<Vec<f32>>>, usize)> {
    let block = nightshift::engine::KV_BLOCK_TOKENS;
    let mut caches: Vec<A::Cache> = (0..3).map(|_| attention.new_cache(8)).collect();
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
    let mut peak = 0;
    for step in 0..=steps {
        let next: Vec<Vec<u32>> = match step {
            0 => PROMPTS.iter().map(|p| p.to_vec()).collect(),
            _ => (0..3).map(|i| vec![tokens.map_or_else(|| argmax(logits[i].last().unwrap()), |t| t[i][step - 1])]).collect(),
        };
        if let Some(window) = window {
            for cache in &mut caches {
                // The next position is `len`: its query sees `len + 1 - window..`.
                attention.release_before(cache, (cache.len() + 1).saturating_sub(window) / block);
            }
        }
        let mut segments: Vec<Segment<'_, A::Cache>> = next.iter().zip(&mut caches).map(|(t, cache)| Segment { tokens: t, cache }).collect();
        let outputs = vec![1; 3];
        let (rows, _) = model.forward_step_timed(attention, &mut segments, &outputs, &[])?;
        for (i, mut r) in rows.into_iter().enumerate() {
            match r.remove(0) {
                StepLogits::Full(l) => logits[i].push(l),
                StepLogits::Argmax(_) => unreachable!("no greedy rows were asked for"),
            }
        }
        peak = peak.max(caches.iter().map(|c| c.blocks()).sum::<usize>());
    }
    Ok((logits, peak))
}

/// Past every layer's window (a Phi-3 whose layers all slide over 16 positions), a sequence's first blocks are given
/// back as it runs ([`Attention::release_before`]): on both backends the logits are bit for bit those of a run that
/// keeps every block, the caches count only the blocks inside the window, and the paged pool gets the blocks back:
/// 8 blocks run three sequences to 54-73 positions (13 blocks kept), where keeping every block fails for want of
/// one. Measured: 6 blocks held at most, against 13.
#[test]
fn blocks_behind_every_layers_window_are_given_back_and_change_nothing() {
    let dir = scratch("window-release").join("model");
    let window = 16;
    write_windowed_phi3(&dir, window);
    let steps = 50;
    let (host_model, _) = Model::load(&dir, &Device::Cpu).unwrap();
    assert_eq!(nightshift::engine::attention::AttentionModel::attention_shape(&host_model).window_of_every_layer(), Some(window));
    let host = host(host_model);
    let (kept, kept_peak) = run_releasing(host.pair(), steps, None, None).unwrap();
    let tokens = fed(&kept);
    let (released, released_peak) = run_releasing(host.pair(), steps, Some(window), Some(&tokens)).unwrap();
    assert_eq!(released, kept, "giving back blocks outside the window changed the host backend's logits");
    assert_eq!(kept_peak, 13);
    // Each sequence holds the block of its next position and those its window reaches back into: 2 of 16 here.
    assert!(released_peak <= 6, "{released_peak} blocks held");
    // The paged pool: every block kept needs 13; given back, 8 are enough.
    let (model, _) = Model::load(&dir, &Device::Cpu).unwrap();
    let big = paged(model, POOL_BLOCKS);
    let (paged_kept, _) = run_releasing(big.pair(), steps, None, Some(&tokens)).unwrap();
    let (model, _) = Model::load(&dir, &Device::Cpu).unwrap();
    let small = paged(model, 8);
    let (paged_released, paged_peak) = run_releasing(small.pair(), steps, Some(window), Some(&tokens)).unwrap();
    assert_eq!(paged_released, paged_kept, "giving back blocks outside the window changed the paged backend's logits");
    assert!(paged_peak <= 6, "{paged_peak} blocks held");
    let err = run_releasing(small.pair(), steps, None, Some(&tokens)).unwrap_err().to_string();
    assert!(err.contains("free blocks"), "{err}");
    // And the paged backend computes the host backend's function.
    let (mut worst, mut scale) = (0f32, 0f32);
    for (a, b) in kept.iter().flatten().zip(paged_released.iter().flatten()) {
        worst = worst.max(max_abs_diff(a, b));
        scale = scale.max(largest(a));
    }
    assert!(worst <= 1e-5 * scale, "paged against host: {worst} of {scale}");
}

/// The host backend computes only what its kernels compute, f32 on the CPU: a bf16 model is refused (it runs the
/// paged backend, which [`Backend::for_model`] picks for it).
#[test]
fn the_host_backend_refuses_a_bf16_model() {
    let dir = scratch("host-bf16").join("model");
    write_tiny_hf_model(&dir, crate::support::HfVariant::Llama3);
    let (bf16, _) = Model::load_hf_as(&dir, &Device::Cpu, DType::BF16).unwrap();
    let err = HostAttention::new(&bf16, DType::F32).err().expect("a bf16 model on the host backend").to_string();
    assert!(err.contains("f32"), "{err}");
    assert_eq!(Backend::for_model(&bf16), Backend::Paged);
}

/// bf16 weights, activations and KV cache (what accelerators run Hugging Face checkpoints in) against f32 on the
/// same weights: the same greedy tokens over a prefill and twelve steps on every variant, logits within 4 % of the
/// largest. Measured: at most 0.74 % (bf16 keeps 8 bits of mantissa); the mixtures of experts 1.8 % (Mixtral) and
/// 1.2 % (Qwen3-MoE), where rounding now and then swaps an expert for the next.
#[test]
fn bf16_paged_path_stays_close_to_f32() {
    for (variant, dir) in hf_variants("bf16") {
        let (cpu, _) = Model::load(&dir, &Device::Cpu).unwrap();
        let (bf16, _) = Model::load_hf_as(&dir, &Device::Cpu, DType::BF16).unwrap();
        assert!(Backend::for_model(&bf16) == Backend::Paged && bf16.dtype() == DType::BF16);
        assert_eq!(Backend::Paged.block_bytes(&bf16, DType::BF16) * 2, Backend::Host.block_bytes(&cpu, DType::F32), "a bf16 KV cache takes half the bytes");
        let rel = paged_against_cpu(&host(cpu), &paged(bf16, POOL_BLOCKS), 12);
        eprintln!("{variant}: bf16 paged vs f32, largest difference {rel:e} of the largest logit");
        assert!(rel <= 0.04, "{variant}: bf16 logits differ by {rel} of the largest");
    }
}

/// Jobs through the binary on the paged path (`NIGHTSHIFT_ATTENTION=paged-tiled` or `runtime.attention`, the CPU
/// running what a GPU runs) give the
/// CPU path's results: greedy rows, with preemption forced by a KV budget of a few sequences, and sampled rows
/// with three choices (forked caches) and logprobs. The tiny f32 model's paths agree to 5.6e-7 of the
/// largest logit, so every token matches.
#[test]
fn jobs_on_the_paged_path_give_the_cpu_paths_results() {
    for variant in [crate::support::HfVariant::Qwen3, crate::support::HfVariant::Gemma3, crate::support::HfVariant::Qwen3Moe] {
        jobs_on_both_paths(variant, None);
    }
    // Every layer sliding: the blocks behind the window given back with forks and the prefix cache. (The budget
    // that preempts the others preempts none here: each sequence holds only its window's blocks.)
    jobs_on_both_paths(crate::support::HfVariant::Phi3, Some(16));
}

/// [`jobs_on_the_paged_path_give_the_cpu_paths_results`] on one variant: Qwen3, and Gemma 3, whose prompts (40 to 80
/// tokens) are longer than its window of 16; with `window`, every layer slides over it (Phi-3), and the running
/// sequences give back the blocks behind it (the metrics' `kv_blocks_released`).
fn jobs_on_both_paths(variant: crate::support::HfVariant, window: Option<usize>) {
    let dir = scratch(&format!("paged-job-{variant:?}"));
    let model = dir.join("model");
    match window {
        Some(window) => write_windowed_phi3(&model, window),
        None => write_tiny_hf_model(&model, variant),
    }
    // A KV budget of about 20 blocks: a few sequences at once. (Gemma 3's 6 layers take three times the bytes.)
    let budget = if variant == crate::support::HfVariant::Gemma3 { "1200KiB" } else { "400KiB" };
    let ids: Vec<String> = (0..12).map(|i| format!("p{i:02}")).collect();
    let texts: Vec<String> = (0..12).map(|i| format!("the tea {i} at the hall, {}", "and more ".repeat(i / 2))).collect();
    let text_refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    write_parquet(&dir.join("in.parquet"), prompts(&ids, &text_refs));
    let run_input = |input: &str, out: &str, generation: &str, runtime: &str, paged: bool| -> std::collections::BTreeMap<String, serde_json::Value> {
        let job = dir.join(format!("{out}.toml"));
        std::fs::write(
            &job,
            format!(
                "[input]\nurl = {:?}\nid_column = \"id\"\n[model]\npath = {:?}\n[generation]\n{generation}\n[runtime]\nmax_seqs = 6\nkv_cache_memory = \"{budget}\"\n{runtime}\n[output]\nurl = {:?}\n",
                dir.join(input).to_string_lossy(),
                model.to_string_lossy(),
                dir.join(out).to_string_lossy()
            ),
        )
        .unwrap();
        let env: &[(&str, &str)] = if paged { &[("NIGHTSHIFT_ATTENTION", "paged-tiled")] } else { &[] };
        nightshift(&["run", job.to_str().unwrap()], env).assert_ok();
        read_results_json(&dir.join(out))
    };
    let run = |out: &str, generation: &str, paged: bool| run_input("in.parquet", out, generation, "", paged);
    for (name, generation) in [
        ("greedy", "max_new_tokens = 24"),
        ("sampled", "max_new_tokens = 16\ntemperature = 0.9\nseed = 7\nn = 3\nlogprobs = 2"),
    ] {
        let cpu = run(&format!("{name}-cpu"), generation, false);
        let paged = run(&format!("{name}-paged"), generation, true);
        if name == "greedy" {
            // The decode kernel's plan (its reference on the CPU) under preemption and continuous batching: decodes
            // beside prefills in most steps.
            let decode = run_input("in.parquet", "greedy-decode", generation, "attention = \"paged-decode\"", false);
            for (id, row) in &cpu {
                assert_eq!((&row["text"], &row["completion_tokens"]), (&decode[id]["text"], &decode[id]["completion_tokens"]), "{id}: host and decode kernel");
            }
            // (Every layer sliding, the same budget runs the rows without preempting any: each holds its window.)
            assert_eq!(read_metrics(&dir.join("greedy-decode"))["preemptions"].unwrap() > 0.0, window.is_none());
        }
        let metrics = read_metrics(&dir.join(format!("{name}-paged")));
        for out in [format!("{name}-cpu"), format!("{name}-paged")] {
            let released = read_metrics(&dir.join(&out))["kv_blocks_released"].unwrap();
            assert_eq!(released > 0.0, window.is_some(), "{out}: {released} blocks given back");
        }
        if name == "greedy" {
            assert_eq!(metrics["preemptions"].unwrap() > 0.0, window.is_none(), "the budget should force preemption: {metrics:?}");
        }
        // A mixture of experts' routing in the metrics: every token through the model (prefilled again after a
        // preemption too) routed to 4 experts in each of its 2 layers.
        let text = crate::support::read_metrics_text(&dir.join(format!("{name}-paged")));
        let routed: Vec<u64> = match text["expert_tokens"].as_str() {
            "" => Vec::new(),
            json => serde_json::from_str(json).unwrap(),
        };
        if variant == crate::support::HfVariant::Qwen3Moe {
            let tokens = metrics["prefill_tokens"].unwrap() + metrics["decode_tokens"].unwrap();
            assert_eq!(routed.len(), 16, "{text:?}");
            assert_eq!(routed.iter().sum::<u64>() as f64, tokens * 2.0 * 4.0, "{text:?} {metrics:?}");
            let load = metrics["expert_load_max_over_mean"].unwrap();
            assert!((1.0..16.0).contains(&load) && metrics["routing_s"].unwrap() > 0.0, "{metrics:?}");
        } else {
            assert!(routed.is_empty() && metrics["expert_load_max_over_mean"].is_none() && metrics["routing_s"] == Some(0.0), "{text:?} {metrics:?}");
        }
        assert_eq!(cpu.len(), 12);
        for (id, row) in &cpu {
            assert_eq!(row["status"], "succeeded", "{row}");
            let other = &paged[id];
            for key in ["text", "completion_tokens", "finish_reason", "choices"] {
                if key == "choices" {
                    let texts = |r: &serde_json::Value| -> Vec<serde_json::Value> {
                        r["choices"].as_array().map(|c| c.iter().map(|c| c["text"].clone()).collect()).unwrap_or_default()
                    };
                    assert_eq!(texts(row), texts(other), "{name} {id}: choices");
                } else {
                    assert_eq!(row[key], other[key], "{name} {id}: {key}");
                }
            }
        }
    }
    // Rows after one instruction: the paged pool serves it from the prefix cache, with the results of the host
    // backend and of no cache.
    let shared: Vec<String> = (0..12).map(|i| format!("{} question {i}", "the tea at the hall and more ".repeat(2))).collect();
    let shared_refs: Vec<&str> = shared.iter().map(String::as_str).collect();
    write_parquet(&dir.join("shared.parquet"), prompts(&ids, &shared_refs));
    let greedy = "max_new_tokens = 24";
    let host = run_input("shared.parquet", "shared-cpu", greedy, "", false);
    // The job file's key.
    let paged = run_input("shared.parquet", "shared-paged", greedy, "attention = \"paged-tiled\"", false);
    let paged_metrics = read_metrics(&dir.join("shared-paged"));
    let off = run_input("shared.parquet", "shared-paged-off", greedy, "prefix_cache = false", true);
    let decode = run_input("shared.parquet", "shared-decode", greedy, "attention = \"paged-decode\"", false);
    assert!(paged_metrics["cached_prompt_tokens"].unwrap() > 0.0, "{paged_metrics:?}");
    for (id, row) in &host {
        assert_eq!(row["status"], "succeeded", "{row}");
        assert_eq!(row["text"], paged[id]["text"], "{id}: host and paged");
        assert_eq!(row["text"], off[id]["text"], "{id}: paged with and without the cache");
        assert_eq!(row["text"], decode[id]["text"], "{id}: host and the decode kernel on cached prefixes");
    }
    // The attention that ran is in the numerics, so reuse never serves the one to the other.
    let numerics = |out: &str| crate::support::kv_metadata_of(crate::support::OutputStore::local(&dir.join(out)).first_results_file())["nightshift.numerics"].clone();
    assert!(!numerics("shared-cpu").contains("attention="), "{}", numerics("shared-cpu"));
    assert!(numerics("shared-paged").contains(";attention=paged-tiled"), "{}", numerics("shared-paged"));
    assert!(numerics("shared-paged-off").contains(";attention=paged-tiled"), "{}", numerics("shared-paged-off"));
    assert!(numerics("shared-decode").contains(";attention=paged-decode"), "{}", numerics("shared-decode"));
}
