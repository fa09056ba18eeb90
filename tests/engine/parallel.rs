//! Tensor parallelism on the CPU: a model split over N ranks (threads of this process, summing partial products
//! with the in-process communicator) against the same model whole, fed the whole model's tokens: the same
//! logits up to f32 summation order, and the same greedy tokens when each runs on its own. On every Hugging Face
//! variant (N = 2: whole kv groups per rank; N = 3 and 4: more ranks than the tiny shape's 2 kv heads, so kv heads
//! are replicated), on Gemma 2/3 and the mixtures from GGUF, on the real SmolLM2 (9 heads, 3 kv heads: N = 2
//! splits its groups 1 and 2), on both attention backends; and a rank that fails mid-step fails the step on every
//! rank, with its reason, instead of hanging.

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use nightshift::engine::parallel::{split_heads, Communicator, Decoder, FailAt, LocalGroup, Rank, TpAttention, TpModel};
use nightshift::engine::{Attention, HostAttention, Model, PagedAttention, StepModel};
use nightshift::job::{ComputeDtype, CpuWeights};

use super::hf_variants;
use super::paged::{fed, forward, largest, max_abs_diff, scenario, write_windowed_phi3, PROMPTS};
use crate::support::*;

fn argmax(v: &[f32]) -> u32 {
    nightshift::engine::sampling::argmax(v)
}

fn whole(path: &Path) -> Model {
    Model::load(path, &Device::Cpu).unwrap().0
}

fn split(path: &Path, ranks: usize) -> TpModel<Model> {
    match Decoder::load(path, &Device::Cpu, CpuWeights::AsStored, ComputeDtype::Auto, ranks).unwrap().0 {
        Decoder::Split(tp) => tp,
        Decoder::Whole(_) => panic!("{ranks} ranks load a split model"),
    }
}

fn host_ranks(tp: &TpModel<Model>) -> TpAttention<HostAttention> {
    TpAttention::new(tp.ranks().iter().map(|m| HostAttention::new(m, candle_core::DType::F32).unwrap()).collect())
}

fn paged_ranks(tp: &TpModel<Model>) -> TpAttention<PagedAttention> {
    TpAttention::new(tp.ranks().iter().map(|m| PagedAttention::new(m, 256).unwrap()).collect())
}

/// What the split model computes against the whole one: the largest logit difference relative to the largest
/// |logit| when fed the whole model's tokens, and the greedy tokens each picks running on its own.
struct Against {
    rel: f32,
    agree: usize,
    total: usize,
    same_free_run: bool,
}

fn against<A: Attention, B: Attention, M: StepModel<B>>(reference: (&Model, &A), ours: (&M, &B), steps: usize) -> Against
where
    Model: StepModel<A>,
{
    let (expected, _) = scenario(reference, steps, None);
    let tokens = fed(&expected);
    let (got, caches) = scenario(ours, steps, Some(&tokens));
    let (mut worst, mut scale, mut agree, mut total) = (0f32, 0f32, 0, 0);
    for (a, b) in expected.iter().flatten().zip(got.iter().flatten()) {
        worst = worst.max(max_abs_diff(a, b));
        scale = scale.max(largest(a));
        agree += usize::from(argmax(a) == argmax(b));
        total += 1;
    }
    for (i, cache) in caches.iter().enumerate() {
        use nightshift::engine::KvCache;
        assert_eq!(cache.len(), PROMPTS[i].len() + expected[i].len() - 1, "sequence {i}'s length on every rank");
    }
    let (free, _) = scenario(ours, steps, None);
    Against { rel: worst / scale, agree, total, same_free_run: fed(&free) == tokens }
}

/// f32 weights, dense products: the ranks' partial sums differ from one model's sums in order only. Measured: at
/// most 1.0e-6 of the largest logit at every N, every greedy token the same.
#[test]
fn tensor_parallel_equals_one_model_on_every_hf_variant() {
    for (variant, dir) in hf_variants("tp") {
        let one = whole(&dir);
        let reference = HostAttention::new(&one, candle_core::DType::F32).unwrap();
        for ranks in [2, 3, 4] {
            let tp = split(&dir, ranks);
            let a = against((&one, &reference), (&tp, &host_ranks(&tp)), 10);
            eprintln!("{variant} at {ranks} ranks (host): largest difference {:e} of the largest logit, {} of {} argmaxes agree", a.rel, a.agree, a.total);
            assert!(a.rel <= 1e-5, "{variant} at {ranks} ranks: logits differ by {} of the largest", a.rel);
            assert!(a.agree == a.total && a.same_free_run, "{variant} at {ranks} ranks: greedy tokens differ");
        }
        let tp = split(&dir, 3);
        let a = against((&one, &reference), (&tp, &paged_ranks(&tp)), 10);
        eprintln!("{variant} at 3 ranks (paged): largest difference {:e} of the largest logit", a.rel);
        assert!(a.rel <= 1e-5 && a.same_free_run, "{variant} at 3 paged ranks: logits differ by {} of the largest", a.rel);
    }
}

/// Gemma 2 and 3 (post-norms after the all-reduce, soft-caps, windows) and the mixtures (each expert's columns
/// split, the router replicated, the shared expert's gate applied before the sum) from GGUF in f32.
#[test]
fn tensor_parallel_equals_one_model_on_gemma_and_experts() {
    let dir = scratch("tp-families");
    let moe = |f: nightshift::synth::Family| matches!(f, nightshift::synth::Family::Mixtral | nightshift::synth::Family::Qwen3Moe | nightshift::synth::Family::Qwen2Moe);
    for (family, head_dim, tied) in super::llama_cpp::FAMILIES.into_iter().filter(|f| f.0.is_gemma() || moe(f.0)) {
        let path = dir.join(format!("{family:?}.gguf"));
        let spec = super::llama_cpp::spec(family, head_dim, tied, super::llama_cpp::rope_theta(family));
        nightshift::synth::write_gguf(&path, &spec, candle_core::quantized::GgmlDType::F32).unwrap();
        let one = whole(&path);
        let reference = HostAttention::new(&one, candle_core::DType::F32).unwrap();
        for ranks in [2, 3] {
            let tp = split(&path, ranks);
            let a = against((&one, &reference), (&tp, &host_ranks(&tp)), 12);
            eprintln!("{family:?} at {ranks} ranks: largest difference {:e} of the largest logit, {} of {} argmaxes agree", a.rel, a.agree, a.total);
            assert!(a.rel <= 1e-5, "{family:?} at {ranks} ranks: logits differ by {} of the largest", a.rel);
            assert!(a.agree == a.total && a.same_free_run, "{family:?} at {ranks} ranks: greedy tokens differ");
        }
    }
}

/// The real SmolLM2 in Q4_1, its heads split 3 + 6 at N = 2 and 3 + 3 + 3 at N = 3 and its 1,536 feed-forward
/// columns in whole blocks. The kernels quantize each product's input per block of 32, and the ranks' splits fall
/// on those blocks, so every block's integer products are the same; only the f32 sums of blocks differ in order,
/// and an ulp can still move an outlier-laden hidden state across a quantization step in the next layer (see
/// `paged_path_tracks_the_cpu_path_on_quantized_smollm2`). Measured: see the assertion's message.
#[test]
fn tensor_parallel_tracks_one_model_on_quantized_smollm2() {
    let path = model_path();
    let one = whole(&path);
    let reference = HostAttention::new(&one, candle_core::DType::F32).unwrap();
    let info = nightshift::engine::models::llama::inspect(&path).unwrap();
    assert_eq!((info.config.heads, info.config.kv_heads), (9, 3));
    for ranks in [2, 3] {
        let slices = split_heads(9, 3, ranks).unwrap();
        assert!(slices.iter().all(|s| s.heads.len() == 3 * s.kv_heads.len()), "whole groups per rank");
        let tp = split(&path, ranks);
        let a = against((&one, &reference), (&tp, &host_ranks(&tp)), 20);
        eprintln!("smollm2 q4_1 at {ranks} ranks: largest difference {:e} of the largest logit, {} of {} argmaxes agree, free run the same: {}", a.rel, a.agree, a.total, a.same_free_run);
        assert!(a.agree * 10 >= a.total * 9, "at {ranks} ranks only {} of {} greedy tokens agree", a.agree, a.total);
        assert!(a.rel <= 0.2, "at {ranks} ranks the logits differ by {} of the largest", a.rel);
    }
}

/// Rank 2 of 3 fails in the middle of the second step: every rank's step ends (none waits for it forever) and the
/// step fails with rank 2's own reason.
#[test]
fn a_rank_that_fails_mid_step_fails_the_step_on_every_rank() {
    let dir = scratch("tp-fail").join("model");
    write_tiny_hf_model(&dir, HfVariant::Llama3);
    let info = nightshift::engine::models::llama::inspect(&dir).unwrap();
    let slices = split_heads(info.config.heads, info.config.kv_heads, 3).unwrap();
    // Two all-reduces a layer: the second step's third.
    let at = 2 * info.config.layers + 3;
    let comm: Arc<dyn Communicator> = Arc::new(FailAt::new(LocalGroup::new(3), 2, at));
    let models: Vec<Model> = slices
        .iter()
        .map(|s| Model::load_rank(&dir, &Device::Cpu, CpuWeights::AsStored, ComputeDtype::Auto, s, Rank::new(s.rank, comm.clone()), None).unwrap().0)
        .collect();
    let tp = TpModel::new(models, comm);
    let attention = host_ranks(&tp);
    let mut cache = attention.new_cache(16);
    let first = forward(&tp, &attention, &mut [nightshift::engine::Segment { tokens: PROMPTS[0], cache: &mut cache }]);
    assert_eq!(first.len(), 1);
    let next = [argmax(&first[0])];
    let outputs = [1];
    let started = std::time::Instant::now();
    let err = tp.forward_step_timed(&attention, &mut [nightshift::engine::Segment { tokens: &next, cache: &mut cache }], &outputs, &[]).unwrap_err().to_string();
    assert!(err.contains(&format!("all-reduce {at} failed on purpose")), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    // The group stays failed: the next step fails at once.
    let again = tp.forward_step_timed(&attention, &mut [nightshift::engine::Segment { tokens: &next, cache: &mut cache }], &outputs, &[]);
    assert!(again.unwrap_err().to_string().contains("tensor-parallel rank 2 failed"));
}

fn write_split_job(dir: &Path, model: &Path, out: &str, ranks: usize) -> std::path::PathBuf {
    let (input, output) = (dir.join("in.parquet"), dir.join(out));
    let extra = format!("unit_rows = 8\n[runtime]\nmax_seqs = 4\ntensor_parallel = {ranks}");
    job_file_for(&dir.join(format!("job-{out}.toml")), model, input.to_str().unwrap(), output.to_str().unwrap(), "max_new_tokens = 12\nlogprobs = 1", &extra)
}

/// A generate job split over 2 and 3 ranks through the binary: every row's greedy text and tokens as the whole
/// model's, each token's log-probability within 1e-4; the results' numerics and the metrics name the split; `plan`
/// prints each rank's share; more ranks than heads is refused with exit 4 naming the key. A rank failing mid-job
/// (the failpoint) ends the run with exit 1 and no `_SUCCESS`, leaving only whole units committed; a rerun resumes
/// and finishes with every row once, as the whole model computes it.
#[test]
fn a_generate_job_runs_split_over_ranks_and_resumes_after_a_rank_fails() {
    let dir = scratch("tp-job");
    let model = dir.join("llama3");
    write_tiny_hf_model(&model, HfVariant::Llama3);
    let ids: Vec<String> = (0..40).map(|i| format!("r{i:02}")).collect();
    let texts: Vec<String> = (0..40).map(|i| format!("the tea {i} at the hall of {}", 40 - i)).collect();
    let text_refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    write_parquet(&dir.join("in.parquet"), prompts(&ids, &text_refs));

    let tokens = |row: &serde_json::Value| -> Vec<(String, f64)> {
        row["logprobs"].as_array().unwrap().iter().map(|t| (t["token"].as_str().unwrap().to_string(), t["logprob"].as_f64().unwrap())).collect()
    };
    nightshift(&["run", write_split_job(&dir, &model, "one", 1).to_str().unwrap()], &[]).assert_ok();
    let whole = read_results_json(&dir.join("one"));
    assert_eq!(whole.len(), 40);
    let same_as_whole = |out: &str| {
        let split = read_results_json(&dir.join(out));
        assert_eq!(split.len(), 40, "{out}");
        let mut worst = 0f64;
        for (id, row) in &whole {
            let other = &split[id];
            assert_eq!((&row["text"], &row["finish_reason"]), (&other["text"], &other["finish_reason"]), "{out}: {id}");
            for ((a, la), (b, lb)) in tokens(row).into_iter().zip(tokens(other)) {
                assert_eq!(a, b, "{out}: {id}");
                worst = worst.max((la - lb).abs());
            }
        }
        eprintln!("{out}: every greedy text the same, log-probabilities within {worst:e}");
        assert!(worst <= 1e-4, "{out}: a log-probability differs by {worst}");
    };
    for ranks in [2, 3] {
        let out = format!("split{ranks}");
        let job = write_split_job(&dir, &model, &out, ranks);
        nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
        same_as_whole(&out);
        let store = OutputStore::local(&dir.join(&out));
        let numerics = kv_metadata_of(store.first_results_file())["nightshift.numerics"].clone();
        assert!(numerics.ends_with(&format!(";tensor_parallel={ranks}")), "{numerics}");
        assert!(store.metrics().iter().all(|m| m["tensor_parallel"] == Some(ranks as f64)), "the metrics name the split");
    }
    let plan = nightshift(&["plan", write_split_job(&dir, &model, "planned", 3).to_str().unwrap()], &[]);
    plan.assert_ok();
    for rank in 0..3 {
        assert!(plan.stdout.contains(&format!("tensor-parallel rank {rank}: ")), "{}", plan.stdout);
    }
    // The tiny shape's 4 heads over 3 ranks: 2, then 1 and 1 sharing a copy of the second kv head.
    assert!(plan.stdout.contains("rank 0: 2 heads, 1 kv heads") && plan.stdout.contains("rank 2: 1 heads, 1 kv heads"), "{}", plan.stdout);
    let refused = nightshift(&["run", write_split_job(&dir, &model, "refused", 5).to_str().unwrap()], &[]);
    assert_eq!(refused.code, 4, "{}", refused.stderr);
    assert!(refused.stderr.contains("runtime.tensor_parallel = 5") && refused.stderr.contains("4 attention heads"), "{}", refused.stderr);

    // Rank 1 of 2 fails in its 200th all-reduce: 2 layers, two a layer, so in the 50th step of about 130 (4
    // sequences at a time), after the first units.
    let job = write_split_job(&dir, &model, "failed", 2);
    let failed = nightshift(&["run", job.to_str().unwrap()], &[("NIGHTSHIFT_FAILPOINT_TP", "1:200")]);
    assert_eq!(failed.code, 1, "{}", failed.stderr);
    assert!(failed.stderr.contains("all-reduce 200 failed on purpose"), "{}", failed.stderr);
    let store = OutputStore::local(&dir.join("failed"));
    assert!(!store.exists("_SUCCESS"), "a failed run looks complete");
    let committed = store.list("_commits").len();
    eprintln!("the failed run committed {committed} of 5 units");
    assert!((1..5).contains(&committed), "{committed} units committed before the rank failed");
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    assert!(store.exists("_SUCCESS"));
    same_as_whole("failed");
}

/// Sampled choices (`n = 3`, a fork of every row's cache after its prefill, on every rank) and a long shared
/// system prompt (the prefix cache's blocks, shared on every rank) give at 2 ranks what they give whole; and so
/// on a Phi-3 whose every layer slides over 16 positions, every rank giving back the blocks behind the window.
#[test]
fn forks_and_cached_prefixes_run_split_as_whole() {
    forks_and_cached_prefixes_on("qwen3", |model| write_tiny_hf_model(model, HfVariant::Qwen3), false);
    forks_and_cached_prefixes_on("phi3-window", |model| write_windowed_phi3(model, 16), true);
}

fn forks_and_cached_prefixes_on(name: &str, write: impl Fn(&Path), windowed: bool) {
    let dir = scratch(&format!("tp-forks-{name}"));
    let model = dir.join(name);
    write(&model);
    let ids: Vec<String> = (0..12).map(|i| format!("s{i:02}")).collect();
    let texts: Vec<String> = (0..12).map(|i| format!("a hat {i} at the tea")).collect();
    let text_refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    write_parquet(&dir.join("in.parquet"), prompts(&ids, &text_refs));
    let system = "the heat at the theatre that the athlete ate at the hearth then the tea that the hatter had ".repeat(2);
    let job = |out: &str, ranks: usize| {
        let path = dir.join(format!("{out}.toml"));
        std::fs::write(
            &path,
            format!(
                "[input]\nurl = {:?}\nid_column = \"id\"\nsystem_prompt = {system:?}\n[model]\npath = {:?}\n[generation]\nmax_new_tokens = 10\nn = 3\ntemperature = 0.8\nseed = 5\n[output]\nurl = {:?}\n[runtime]\nmax_seqs = 6\ntensor_parallel = {ranks}\n",
                dir.join("in.parquet").to_string_lossy(),
                model.to_string_lossy(),
                dir.join(out).to_string_lossy()
            ),
        )
        .unwrap();
        nightshift(&["run", path.to_str().unwrap()], &[]).assert_ok();
        read_results_json(&dir.join(out))
    };
    let whole = job("whole", 1);
    let split = job("split", 2);
    for out in ["whole", "split"] {
        let released = read_metrics(&dir.join(out))["kv_blocks_released"].unwrap();
        assert_eq!(released > 0.0, windowed, "{name} {out}: {released} blocks given back");
    }
    let cached: u64 = whole.values().map(|r| r["cached_tokens"].as_u64().unwrap()).sum();
    assert!(cached >= 11 * 16, "the rows after the first take their shared prefix from the cache ({cached} tokens)");
    for (id, row) in &whole {
        let other = &split[id];
        assert_eq!(row["choices"], other["choices"], "{id}");
        assert_eq!(row["cached_tokens"], other["cached_tokens"], "{id}");
        assert_eq!(row["choices"].as_array().map(Vec::len), Some(3));
    }
}

/// OLMoE's q/k norms take whole q and k rows, which a rank holds only part of: a split is refused with the reason,
/// from GGUF and from safetensors.
#[test]
fn olmoe_is_not_split_over_ranks() {
    let dir = scratch("tp-olmoe");
    let spec = super::llama_cpp::spec(nightshift::synth::Family::Olmoe, 16, false, 10000);
    let gguf = dir.join("olmoe.gguf");
    nightshift::synth::write_gguf(&gguf, &spec, candle_core::quantized::GgmlDType::F32).unwrap();
    let hf = dir.join("olmoe");
    nightshift::synth::write_hf(&hf, &spec).unwrap();
    for path in [&gguf, &hf] {
        let err = Decoder::load(path, &Device::Cpu, CpuWeights::AsStored, ComputeDtype::Auto, 2).err().expect("refused");
        assert!(err.to_string().contains("whole q and k rows"), "{err}");
        Decoder::load(path, &Device::Cpu, CpuWeights::AsStored, ComputeDtype::Auto, 1).unwrap();
    }
    // This model is too narrow for the padded layouts (they would more than add a third): `q8_0` requantizes it
    // unpadded, which full-row norms take.
    Decoder::load(&gguf, &Device::Cpu, CpuWeights::Q8_0, ComputeDtype::Auto, 1).unwrap();
}
