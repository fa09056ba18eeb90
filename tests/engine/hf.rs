//! The decoder on Hugging Face directories the tests write with random weights, one per variant (llama with
//! Llama 3 RoPE scaling, SmolLM-style tied llama, mistral with a wide head_dim, qwen2 with biases, qwen3 with q/k
//! norms): logits equal candle-transformers' implementation of each on the same weights, a packed pass equals
//! the same work done piecewise, malformed directories are errors, and a job runs end to end through the CLI.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_transformers::models::{llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe};
use nightshift::engine::attention::HostCache;
use nightshift::engine::{Attention, HostAttention, KvCache, Model, Segment};

use crate::support::*;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    nightshift::engine::sampling::argmax(v)
}

fn tiny(name: &str, variant: HfVariant) -> PathBuf {
    let dir = scratch(&format!("hf-{name}-{variant:?}")).join("model");
    write_tiny_hf_model(&dir, variant);
    dir
}

/// candle-transformers' model of a variant, with its own KV cache.
enum Reference {
    Llama(Box<llama::Llama>, llama::Cache),
    Mistral(Box<mistral::Model>),
    Qwen2(Box<qwen2::ModelForCausalLM>),
    Qwen3(Box<qwen3::ModelForCausalLM>),
    Phi3(Box<phi3::Model>),
    Mixtral(Box<mixtral::Model>),
    Qwen3Moe(Box<qwen3_moe::ModelForCausalLM>),
    Qwen2Moe(Box<qwen2_moe::Model>),
}

impl Reference {
    fn load(dir: &Path, variant: HfVariant) -> Reference {
        let device = Device::Cpu;
        let json = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &device).unwrap();
        let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &device);
        match variant {
            HfVariant::Llama3 | HfVariant::SmolLm => {
                let config = serde_json::from_str::<llama::LlamaConfig>(&json).unwrap().into_config(false);
                let cache = llama::Cache::new(true, DType::F32, &config, &device).unwrap();
                Reference::Llama(Box::new(llama::Llama::load(vb, &config).unwrap()), cache)
            }
            HfVariant::Mistral => Reference::Mistral(Box::new(mistral::Model::new(&serde_json::from_str(&json).unwrap(), vb).unwrap())),
            HfVariant::Qwen2 => Reference::Qwen2(Box::new(qwen2::ModelForCausalLM::new(&serde_json::from_str(&json).unwrap(), vb).unwrap())),
            HfVariant::Qwen3 => Reference::Qwen3(Box::new(qwen3::ModelForCausalLM::new(&serde_json::from_str(&json).unwrap(), vb).unwrap())),
            // Gemma's reference is llama.cpp (tests/engine/llama_cpp.rs): candle-transformers' gemma2 and gemma3 let
            // a sliding layer's query see `sliding_window + 1` positions, one more than Hugging Face's.
            HfVariant::Phi3 | HfVariant::Phi4Mini => Reference::Phi3(Box::new(phi3::Model::new(&serde_json::from_str(&json).unwrap(), vb).unwrap())),
            // candle-transformers' Mixtral config wants a window and a flash-attention flag (Mixtral's own is null).
            HfVariant::Mixtral => {
                let mut config: serde_json::Value = serde_json::from_str(&json).unwrap();
                config["sliding_window"] = config["max_position_embeddings"].clone();
                config["use_flash_attn"] = false.into();
                Reference::Mixtral(Box::new(mixtral::Model::new(&serde_json::from_value(config).unwrap(), vb).unwrap()))
            }
            HfVariant::Qwen3Moe => Reference::Qwen3Moe(Box::new(qwen3_moe::ModelForCausalLM::new(&serde_json::from_str(&json).unwrap(), vb).unwrap())),
            HfVariant::Qwen2Moe => Reference::Qwen2Moe(Box::new(qwen2_moe::Model::new(&serde_json::from_str(&json).unwrap(), vb).unwrap())),
            HfVariant::Gemma2 | HfVariant::Gemma3 => unreachable!("no candle-transformers reference for {variant:?}"),
        }
    }

    /// Logits after the last of `tokens`, which start at position `offset`.
    fn forward(&mut self, tokens: &[u32], offset: usize) -> Vec<f32> {
        let ids = Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let logits = match self {
            Reference::Llama(model, cache) => model.forward(&ids, offset, cache),
            Reference::Mistral(model) => model.forward(&ids, offset),
            Reference::Qwen2(model) => model.forward(&ids, offset),
            Reference::Qwen3(model) => model.forward(&ids, offset),
            Reference::Phi3(model) => model.forward(&ids, offset),
            Reference::Mixtral(model) => model.forward(&ids, offset),
            Reference::Qwen3Moe(model) => model.forward(&ids, offset),
            Reference::Qwen2Moe(model) => model.forward(&ids, offset),
        };
        logits.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }
}

/// An arbitrary prompt of ids inside every variant's tokenizer vocabulary.
const PROMPT: &[u32] = &[260, 85, 115, 101, 114, 198, 72, 105, 33, 261, 198];

/// Logits of a prefill and eight greedy decode steps, against candle-transformers on the same weights, within 1e-4.
/// Measured largest differences (and largest |logit|): llama3 4.3e-6 (7.9), smollm 1.5e-5 (64.6), mistral 2.4e-6
/// (9.5), qwen2 2.3e-5 (61.4), qwen3 1.1e-5 (64.4), phi-4-mini 4.6e-5 (72.3); the bf16 and f16 ones (smollm,
/// mistral, qwen3, qwen3-moe) with their matrices in 16 bits on nightshift's kernels, candle-transformers' widened.
fn parity_with_candle_transformers(variant: HfVariant) {
    let dir = tiny("parity", variant);
    let (model, info) = Model::load(&dir, &Device::Cpu).unwrap();
    let host = HostAttention::new(&model, DType::F32).unwrap();
    let family = match variant {
        HfVariant::Llama3 | HfVariant::SmolLm => "llama".to_string(),
        HfVariant::Qwen3Moe => "qwen3_moe".to_string(),
        HfVariant::Qwen2Moe => "qwen2_moe".to_string(),
        HfVariant::Phi4Mini => "phi3".to_string(),
        other => format!("{other:?}").to_lowercase(),
    };
    assert_eq!(info.config.architecture, family);
    let mut reference = Reference::load(&dir, variant);
    let mut cache = host.new_cache(32);
    let mut ours = model.forward(&host, &mut [Segment { tokens: PROMPT, cache: &mut cache }]).unwrap().remove(0);
    let mut theirs = reference.forward(PROMPT, 0);
    let mut worst = max_abs_diff(&ours, &theirs);
    let mut largest = ours.iter().fold(0f32, |m, x| m.max(x.abs()));
    for _ in 0..8 {
        assert_eq!(argmax(&ours), argmax(&theirs), "{variant:?}: greedy tokens differ at position {}", cache.len());
        let next = [argmax(&ours)];
        let position = cache.len();
        ours = model.forward(&host, &mut [Segment { tokens: &next, cache: &mut cache }]).unwrap().remove(0);
        theirs = reference.forward(&next, position);
        worst = worst.max(max_abs_diff(&ours, &theirs));
        largest = ours.iter().fold(largest, |m, x| m.max(x.abs()));
    }
    eprintln!("{variant:?}: largest logit difference from candle-transformers {worst:e} (largest |logit| {largest:.1})");
    assert!(worst <= 1e-4, "{variant:?}: logits differ from candle-transformers by {worst}");
}

#[test]
fn llama3_with_rope_scaling_equals_candle_transformers() {
    parity_with_candle_transformers(HfVariant::Llama3);
}

#[test]
fn tied_bf16_llama_equals_candle_transformers() {
    parity_with_candle_transformers(HfVariant::SmolLm);
}

#[test]
fn mistral_with_a_wide_head_equals_candle_transformers() {
    parity_with_candle_transformers(HfVariant::Mistral);
}

#[test]
fn qwen2_with_biases_equals_candle_transformers() {
    parity_with_candle_transformers(HfVariant::Qwen2);
}

#[test]
fn qwen3_with_qk_norms_equals_candle_transformers() {
    parity_with_candle_transformers(HfVariant::Qwen3);
}

#[test]
fn phi3_with_fused_projections_equals_candle_transformers() {
    parity_with_candle_transformers(HfVariant::Phi3);
    // Phi-4-mini's partial rotary and tied embeddings.
    parity_with_candle_transformers(HfVariant::Phi4Mini);
}

#[test]
fn mixtral_and_qwen3_moe_experts_equal_candle_transformers() {
    parity_with_candle_transformers(HfVariant::Mixtral);
    parity_with_candle_transformers(HfVariant::Qwen3Moe);
    // Qwen2-MoE's shared expert and its sigmoid gate, its routed weights not renormalized, q/k/v biases.
    parity_with_candle_transformers(HfVariant::Qwen2Moe);
}

/// A 16-bit checkpoint's matrices stay in 16 bits on the CPU kernels (the default, `cpu_weights = "as-stored"`):
/// the same weights as widened to f32 at load (`"f32"`), each product's sums in another order. Logits of a prefill
/// and eight greedy steps within 1e-4 of the widened model's (the same bound as candle-transformers', which widens),
/// the same greedy tokens, and the matrices in about half the bytes.
fn sixteen_bits_equal_widened(variant: HfVariant) {
    use nightshift::job::{ComputeDtype, CpuWeights};
    let dir = tiny("sixteen", variant);
    let (packed, _) = Model::load_as(&dir, &Device::Cpu, CpuWeights::AsStored, ComputeDtype::Auto).unwrap();
    let (widened, _) = Model::load_as(&dir, &Device::Cpu, CpuWeights::F32, ComputeDtype::Auto).unwrap();
    assert!(packed.layout().name().contains("as stored, on the CPU kernels"), "{variant:?}: {}", packed.layout().name());
    assert_eq!(widened.layout().name(), "as-stored");
    assert_eq!(packed.dtype(), DType::F32, "activations stay f32");
    let (a, b) = (HostAttention::new(&packed, DType::F32).unwrap(), HostAttention::new(&widened, DType::F32).unwrap());
    let (mut ca, mut cb) = (a.new_cache(32), b.new_cache(32));
    let mut ours = packed.forward(&a, &mut [Segment { tokens: PROMPT, cache: &mut ca }]).unwrap().remove(0);
    let mut theirs = widened.forward(&b, &mut [Segment { tokens: PROMPT, cache: &mut cb }]).unwrap().remove(0);
    let mut worst = max_abs_diff(&ours, &theirs);
    for _ in 0..8 {
        assert_eq!(argmax(&ours), argmax(&theirs), "{variant:?}: greedy tokens differ at position {}", ca.len());
        let next = [argmax(&ours)];
        ours = packed.forward(&a, &mut [Segment { tokens: &next, cache: &mut ca }]).unwrap().remove(0);
        theirs = widened.forward(&b, &mut [Segment { tokens: &next, cache: &mut cb }]).unwrap().remove(0);
        worst = worst.max(max_abs_diff(&ours, &theirs));
    }
    let (small, large) = (packed.weight_bytes(), widened.weight_bytes());
    eprintln!("{variant:?}: 16-bit vs widened: largest logit difference {worst:e}, weights {small} vs {large} bytes");
    assert!(worst <= 1e-4, "{variant:?}: 16-bit and widened logits differ by {worst}");
    // The embedding table stays f32 for the lookups; every matrix halves.
    assert!(small * 10 < large * 7, "{variant:?}: {small} bytes in 16 bits vs {large} widened");
}

#[test]
fn sixteen_bit_matrices_on_the_kernels_equal_them_widened() {
    // bf16 tied (the lm_head from the stored table), f16 with a wide head, bf16 experts.
    for variant in [HfVariant::SmolLm, HfVariant::Mistral, HfVariant::Qwen3Moe] {
        sixteen_bits_equal_widened(variant);
    }
    // An f32 checkpoint has nothing to keep in 16 bits.
    let (model, _) = Model::load_as(&tiny("sixteen", HfVariant::Llama3), &Device::Cpu, Default::default(), Default::default()).unwrap();
    assert_eq!(model.layout().name(), "as-stored");
}

/// Three prompts of different lengths packed into one pass, then ten greedy steps of all three together, against
/// each sequence alone: the same tokens, logits within 1e-5. And a prompt prefilled in one pass equals it fed
/// token by token, within 1e-4. Measured: bit-identical in both for every dense variant (f32 products run at least
/// eight rows, see `DENSE_MIN_ROWS`); the mixtures of experts, whose experts see other rows batched, differ
/// batched by 2.4e-6 (Mixtral), 1.4e-6 (Qwen3-MoE, also prefilled vs token by token) and 2.6e-6 (Qwen2-MoE); the
/// tolerances leave room for CPUs whose gemm kernels block differently.
fn batched_equals_one_at_a_time(variant: HfVariant) {
    let dir = tiny("batched", variant);
    let (model, _) = Model::load(&dir, &Device::Cpu).unwrap();
    let host = HostAttention::new(&model, DType::F32).unwrap();
    let prompts: [&[u32]; 3] = [PROMPT, &[260, 72, 105, 261], &[104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 32, 116, 104, 101, 32, 101, 110, 100]];

    let mut alone_caches: Vec<HostCache> = prompts.iter().map(|_| host.new_cache(8)).collect();
    let mut alone: Vec<Vec<f32>> = prompts
        .iter()
        .zip(&mut alone_caches)
        .map(|(p, cache)| model.forward(&host, &mut [Segment { tokens: p, cache }]).unwrap().remove(0))
        .collect();
    let mut packed_caches: Vec<HostCache> = prompts.iter().map(|_| host.new_cache(8)).collect();
    let mut packed = {
        let mut segments: Vec<Segment<'_, HostCache>> = prompts.iter().zip(&mut packed_caches).map(|(p, cache)| Segment { tokens: p, cache }).collect();
        model.forward(&host, &mut segments).unwrap()
    };
    let mut worst = 0f32;
    for _ in 0..10 {
        let next: Vec<[u32; 1]> = alone.iter().map(|l| [argmax(l)]).collect();
        for i in 0..3 {
            worst = worst.max(max_abs_diff(&alone[i], &packed[i]));
            assert_eq!(next[i][0], argmax(&packed[i]), "{variant:?}: sequence {i} picks another token in a batch");
        }
        for i in 0..3 {
            alone[i] = model.forward(&host, &mut [Segment { tokens: &next[i], cache: &mut alone_caches[i] }]).unwrap().remove(0);
        }
        let mut segments: Vec<Segment<'_, HostCache>> = next.iter().zip(&mut packed_caches).map(|(t, cache)| Segment { tokens: t, cache }).collect();
        packed = model.forward(&host, &mut segments).unwrap();
    }
    eprintln!("{variant:?}: largest batched vs alone difference {worst:e}");
    assert!(worst <= 1e-5, "{variant:?}: batching changed a logit by {worst}");

    let mut stepwise = host.new_cache(8);
    let mut last = Vec::new();
    for token in prompts[2] {
        last = model.forward(&host, &mut [Segment { tokens: std::slice::from_ref(token), cache: &mut stepwise }]).unwrap().remove(0);
    }
    let mut whole = host.new_cache(8);
    let one_pass = model.forward(&host, &mut [Segment { tokens: prompts[2], cache: &mut whole }]).unwrap().remove(0);
    let diff = max_abs_diff(&one_pass, &last);
    eprintln!("{variant:?}: prefill vs token-by-token difference {diff:e}");
    assert!(diff <= 1e-4, "{variant:?}: prefill and token-by-token logits differ by {diff}");
}

#[test]
fn every_variant_gives_the_same_results_batched_and_alone() {
    for variant in HfVariant::ALL {
        batched_equals_one_at_a_time(variant);
    }
}

/// Each broken directory fails to load with a message naming what is wrong, never a panic.
#[test]
fn malformed_directories_are_model_errors_that_say_what_is_wrong() {
    let dir = tiny("malformed", HfVariant::Qwen2);
    let error = |dir: &Path| {
        let Err(load) = Model::load(dir, &Device::Cpu) else { panic!("{} loads", dir.display()) };
        let load = load.to_string();
        let inspect = nightshift::engine::models::llama::inspect(dir).expect_err("the directory inspects").to_string();
        assert_eq!(load, inspect, "validate and run report the same problem");
        load
    };
    let broken = |name: &str, edit: &dyn Fn(&Path)| {
        let copy = dir.parent().unwrap().join(name);
        std::fs::create_dir_all(&copy).unwrap();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
        }
        edit(&copy);
        error(&copy)
    };
    let tensors = || candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();

    let e = broken("no-bias", &|d| {
        let mut t = tensors();
        t.remove("model.layers.1.self_attn.k_proj.bias");
        candle_core::safetensors::save(&t, d.join("model.safetensors")).unwrap();
    });
    assert!(e.contains("`model.layers.1.self_attn.k_proj.bias` is missing"), "{e}");
    let e = broken("wrong-shape", &|d| {
        let mut t = tensors();
        t.insert("model.layers.0.mlp.up_proj.weight".into(), Tensor::zeros((128, 128), DType::F32, &Device::Cpu).unwrap());
        candle_core::safetensors::save(&t, d.join("model.safetensors")).unwrap();
    });
    assert!(e.contains("`model.layers.0.mlp.up_proj.weight` has shape [128, 128], expected [256, 128]"), "{e}");
    let e = broken("truncated", &|d| {
        let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
        std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    });
    assert!(e.contains("model.safetensors"), "{e}");
    let e = broken("no-weights", &|d| std::fs::remove_file(d.join("model.safetensors")).unwrap());
    assert!(e.contains("model.safetensors"), "{e}");
    let e = broken("huge", &|d| {
        let text = std::fs::read_to_string(d.join("config.json")).unwrap();
        std::fs::write(d.join("config.json"), text.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 100000000")).unwrap();
    });
    assert!(e.contains("config.json") && e.contains("num_hidden_layers"), "{e}");
    let e = broken("not-json", &|d| std::fs::write(d.join("config.json"), "{\"model_type\": ").unwrap());
    assert!(e.contains("config.json") && e.contains("not valid JSON"), "{e}");
    let e = broken("bad-tokenizer", &|d| std::fs::write(d.join("tokenizer.json"), "{}").unwrap());
    assert!(e.contains("tokenizer.json"), "{e}");
    let e = broken("unknown-family", &|d| {
        let text = std::fs::read_to_string(d.join("config.json")).unwrap();
        std::fs::write(d.join("config.json"), text.replace("\"qwen2\"", "\"gemma\"")).unwrap();
    });
    assert!(e.contains("gemma"), "{e}");
}

/// Sharded weights (`model.safetensors.index.json`) load as the single file does.
#[test]
fn sharded_weights_equal_a_single_file() {
    let dir = tiny("sharded", HfVariant::Qwen3);
    let (single, _) = Model::load(&dir, &Device::Cpu).unwrap();
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let first: Vec<&String> = names.iter().step_by(2).copied().collect();
    let second: Vec<&String> = names.iter().skip(1).step_by(2).copied().collect();
    let mut map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", &first), ("model-00002-of-00002.safetensors", &second)] {
        let shard: std::collections::HashMap<String, Tensor> = part.iter().map(|n| ((*n).clone(), tensors[*n].clone())).collect();
        candle_core::safetensors::save(&shard, dir.join(file)).unwrap();
        for n in part.iter() {
            map.insert((*n).clone(), file.into());
        }
    }
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
    let (sharded, _) = Model::load(&dir, &Device::Cpu).unwrap();
    let run = |m: &Model| {
        let host = HostAttention::new(m, DType::F32).unwrap();
        let mut cache = host.new_cache(16);
        m.forward(&host, &mut [Segment { tokens: PROMPT, cache: &mut cache }]).unwrap().remove(0)
    };
    assert_eq!(run(&single), run(&sharded));
}

fn write_job(dir: &Path, model: &Path, out: &str) -> PathBuf {
    let (input, output) = (dir.join("in.parquet"), dir.join(out));
    job_file_for(&dir.join("job.toml"), model, input.to_str().unwrap(), output.to_str().unwrap(), "max_new_tokens = 12", "")
}

/// A generate job whose `model.path` is a Hugging Face directory runs through the binary: every row gets a
/// result, greedy outputs do not depend on `max_seqs`, validate describes the model; a malformed config.json
/// fails the run with exit 4 and a message naming the file and the key, before anything is written.
#[test]
fn a_generate_job_runs_on_a_hugging_face_directory() {
    let dir = scratch("hf-job");
    let model = dir.join("qwen2");
    write_tiny_hf_model(&model, HfVariant::Qwen2);
    let ids: Vec<String> = (0..10).map(|i| format!("h{i:02}")).collect();
    let texts: Vec<String> = (0..10).map(|i| format!("the tea {i} at the hall")).collect();
    let text_refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    write_parquet(&dir.join("in.parquet"), prompts(&ids, &text_refs));

    let job = write_job(&dir, &model, "out");
    nightshift(&["run", job.to_str().unwrap(), "--max-seqs", "1"], &[]).assert_ok();
    let one = read_results(&dir.join("out"));
    let job = write_job(&dir, &model, "out-batched");
    nightshift(&["run", job.to_str().unwrap(), "--max-seqs", "8"], &[]).assert_ok();
    let batched = read_results(&dir.join("out-batched"));
    assert_eq!(one.len(), 10);
    for (id, row) in &one {
        assert_eq!(row.status, "succeeded", "{row:?}");
        assert!(row.completion_tokens >= 1 && row.completion_tokens <= 12, "{row:?}");
        // ChatML around the prompt: `<|im_start|>user\n` (3 tokens), the text, `<|im_end|>\n<|im_start|>assistant\n`.
        assert!(row.prompt_tokens.unwrap() as usize > texts[0].len() / 2, "{row:?}");
        let other = &batched[id];
        assert_eq!((&row.text, row.completion_tokens, &row.finish_reason), (&other.text, other.completion_tokens, &other.finish_reason), "{id}");
    }
    let run = nightshift(&["validate", job.to_str().unwrap()], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("(qwen2)") && run.stdout.contains("f32 x"), "{}", run.stdout);

    let text = std::fs::read_to_string(model.join("config.json")).unwrap();
    std::fs::write(model.join("config.json"), text.replace("\"num_attention_heads\": 4", "\"num_attention_heads\": 3")).unwrap();
    let job = write_job(&dir, &model, "out-broken");
    let run = nightshift(&["run", job.to_str().unwrap()], &[]);
    assert_eq!(run.code, 4, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert!(run.stderr.contains("config.json") && run.stderr.contains("3 attention heads"), "{}", run.stderr);
    assert!(!dir.join("out-broken/_plan.json").exists() && !dir.join("out-broken/data").exists(), "a run that cannot load its model wrote output");
}

#[test]
fn every_end_token_a_directory_names_stops_generation() {
    let dir = tiny("ends", HfVariant::Qwen2);
    // Llama 3.1 style: several end tokens in generation_config.json. 258 is an ordinary merge token, so only the
    // list makes it stop generation.
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [261, 259, 258]}"#).unwrap();
    let info = nightshift::engine::models::llama::inspect(&dir).unwrap();
    let im_end = info.vocab.tokens.iter().position(|t| t == "<|im_end|>").unwrap() as u32;
    assert_eq!(im_end, 261);
    // tokenizer_config.json's eos_token first, then the list's others.
    assert_eq!((info.vocab.eos, info.vocab.eot, info.vocab.more_ends.clone()), (Some(261), Some(259), vec![258]));
    let stop = nightshift::engine::StopRules::new(&info.vocab);
    for id in [261, 259, 258] {
        assert!(stop.end_tokens.contains(&id), "{id} does not stop generation");
    }
}

/// `synth-model --layers` keeps a shape's attention in fewer layers; `--layers` past the shape's and `--window` on a
/// shape without a sliding window are refused with exit 2, naming the flag.
#[test]
fn synth_model_takes_fewer_layers_and_refuses_what_the_shape_lacks() {
    let dir = crate::support::scratch("synth-layers");
    let one = dir.join("one");
    crate::support::nightshift(&["synth-model", one.to_str().unwrap(), "--shape", "tiny", "--layers", "1"], &[]).assert_ok();
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(one.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_hidden_layers"], 1, "{config}");
    nightshift::engine::Model::load(&one, &candle_core::Device::Cpu).unwrap();
    for (args, says) in [(&["--layers", "3"][..], "--layers"), (&["--layers", "0"][..], "--layers"), (&["--window", "8"][..], "no sliding window")] {
        let out = dir.join("refused");
        let mut all = vec!["synth-model", out.to_str().unwrap(), "--shape", "tiny"];
        all.extend_from_slice(args);
        let run = crate::support::nightshift(&all, &[]);
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(says), "{args:?}: {}", run.stderr);
        assert!(!out.join("config.json").exists(), "{args:?} wrote a model");
    }
}
