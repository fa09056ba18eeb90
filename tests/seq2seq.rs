//! Encoder-decoder generation (T5) on random-weight models the tests write (no T5 weights come from a package
//! registry here): parity with candle-transformers' T5 on the same weights, batched equals one-at-a-time, and the
//! job end to end through the CLI with Parquet in and out.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use nightshift::engine::models::t5::T5;

use crate::support::*;

const WORDS: &[&str] = &[
    "the", "printer", "jams", "every", "time", "i", "was", "charged", "twice", "please", "refund", "payment", "app", "crashes",
    "when", "open", "settings", "team", "cannot", "access", "drive", "since", "morning", "password", "reset", "email",
    "never", "arrives", "invoice", "is", "blank", "website", "very", "slow", "today", "laptop", "order", "delivery",
    "address", "projector", "shows", "no", "signal", "cancel", "my", "subscription", "summarise", "ticket", "a", "short",
    "sentence", "about", "problem", "user", "needs", "help", "with", "broken", "device", "billing", "issue", "login",
    "fails", "after", "update", "network", "error", "paper", "stuck", "queue", "jobs", "floor", "third", "card", "march",
    "april", "second", "duplicate", "android", "reinstall", "shared", "path", "found", "spam", "folder", "checked",
    "download", "page", "customers", "gave", "up", "room", "hdmi", "week", "end",
];

/// Writes a random-weight T5 directory: config.json, model.safetensors and a SentencePiece-style (Unigram,
/// Metaspace) tokenizer.json whose post-processor appends `</s>`, as T5's does. `gated` picks gated-GELU feed-forward layers and an untied
/// output projection (the T5 v1.1 layout); otherwise ReLU and tied embeddings (the original T5 layout).
pub fn write_tiny_t5(dir: &Path, gated: bool) {
    std::fs::create_dir_all(dir).unwrap();
    let (vocab, d, dk, heads, ff, layers) = (3 + WORDS.len(), 32usize, 8usize, 4usize, 64usize, 2usize);
    let inner = dk * heads;
    let config = serde_json::json!({
        "model_type": "t5", "vocab_size": vocab, "d_model": d, "d_kv": dk, "d_ff": ff, "num_layers": layers,
        "num_decoder_layers": layers, "num_heads": heads, "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128, "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6,
        "initializer_factor": 1.0, "feed_forward_proj": if gated { "gated-gelu" } else { "relu" },
        "tie_word_embeddings": !gated, "is_encoder_decoder": true, "use_cache": false, "pad_token_id": 0,
        "eos_token_id": 1, "decoder_start_token_id": 0
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();

    let mut rng = nightshift::synth::Random::new(if gated { 0x51 } else { 0x7e });
    let mut random = |dims: &[usize], scale: f32| -> Tensor { rng.tensor(dims, scale).unwrap() };
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let s = 1.0 / (d as f32).sqrt();
    tensors.insert("shared.weight".into(), random(&[vocab, d], 1.0));
    for (stack, decoder) in [("encoder", false), ("decoder", true)] {
        for i in 0..layers {
            let p = format!("{stack}.block.{i}.layer");
            let attention = |name: String, tensors: &mut HashMap<String, Tensor>, random: &mut dyn FnMut(&[usize], f32) -> Tensor| {
                for w in ["q", "k", "v"] {
                    tensors.insert(format!("{name}.{w}.weight"), random(&[inner, d], s));
                }
                tensors.insert(format!("{name}.o.weight"), random(&[d, inner], s));
            };
            attention(format!("{p}.0.SelfAttention"), &mut tensors, &mut random);
            tensors.insert(format!("{p}.0.layer_norm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
            if decoder {
                attention(format!("{p}.1.EncDecAttention"), &mut tensors, &mut random);
                tensors.insert(format!("{p}.1.layer_norm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
            }
            let f = if decoder { 2 } else { 1 };
            if gated {
                tensors.insert(format!("{p}.{f}.DenseReluDense.wi_0.weight"), random(&[ff, d], s));
                tensors.insert(format!("{p}.{f}.DenseReluDense.wi_1.weight"), random(&[ff, d], s));
            } else {
                tensors.insert(format!("{p}.{f}.DenseReluDense.wi.weight"), random(&[ff, d], s));
            }
            tensors.insert(format!("{p}.{f}.DenseReluDense.wo.weight"), random(&[d, ff], 1.0 / (ff as f32).sqrt()));
            tensors.insert(format!("{p}.{f}.layer_norm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
        }
        tensors.insert(format!("{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"), random(&[32, heads], 1.0));
        tensors.insert(format!("{stack}.final_layer_norm.weight"), random(&[d], 0.2).affine(1.0, 1.0).unwrap());
    }
    if gated {
        tensors.insert("lm_head.weight".into(), random(&[vocab, d], s * 4.0));
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();

    // A SentencePiece-style tokenizer as T5's: a Unigram model over "▁word" pieces, Metaspace splitting and
    // decoding, `</s>` appended by the post-processor, text lowercased.
    let mut pieces = vec![("<pad>".to_string(), 0.0), ("</s>".to_string(), 0.0), ("<unk>".to_string(), 0.0)];
    pieces.extend(WORDS.iter().enumerate().map(|(i, w)| (format!("\u{2581}{w}"), -1.0 - i as f64 / 100.0)));
    let tokenizer = nightshift::synth::t5::unigram_tokenizer_json(&pieces, true);
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_string(&tokenizer).unwrap()).unwrap();
}

fn tiny_t5(name: &str, gated: bool) -> PathBuf {
    let dir = scratch(name).join("t5");
    write_tiny_t5(&dir, gated);
    dir
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

const SOURCE: &[u32] = &[3, 10, 25, 7, 40, 41, 12, 1];

fn parity_with_candle_transformers(gated: bool) {
    use candle_transformers::models::t5;
    let dir = tiny_t5(if gated { "t5-parity-gated" } else { "t5-parity" }, gated);
    let ours = T5::load(&dir, &Device::Cpu).unwrap();
    let config: t5::Config = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut reference =
        t5::T5ForConditionalGeneration::load(candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu), &config).unwrap();

    let input = Tensor::new(SOURCE, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let theirs_encoded = reference.encode(&input).unwrap();
    let ours_encoded = ours.encode(&[SOURCE]).unwrap().remove(0);
    let diff = max_abs_diff(
        &ours_encoded.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        &theirs_encoded.squeeze(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    eprintln!("encoder output difference from candle-transformers (gated: {gated}): {diff:e}");
    assert!(diff < 1e-4, "encoder outputs differ by {diff}");

    // Greedy decoding, step by step: candle-transformers recomputes the whole prefix (use_cache = false), nightshift
    // extends its caches. Six steps: candle-transformers' decoder uses bidirectional position buckets, which agree
    // with T5's causal ones only for distances under a quarter of the buckets (8 here).
    let mut state = ours.start(&ours_encoded).unwrap();
    let mut prefix = vec![0u32];
    let mut worst = 0f32;
    for _ in 0..6 {
        let ours_logits = ours.decode_step(&[*prefix.last().unwrap()], &mut [&mut state]).unwrap().remove(0);
        let ids = Tensor::new(prefix.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let mut theirs_logits = reference.decode(&ids, &theirs_encoded).unwrap().squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        if !gated {
            // With tied embeddings, Hugging Face's T5 scales the decoder output by d_model^-0.5 before the output
            // projection; candle-transformers 0.11.1 multiplies by d_model^0.5 instead, so its logits are d_model
            // times nightshift's (the same argmax, a different temperature). Compared on Hugging Face's scale.
            let d_model = config.d_model as f32;
            theirs_logits.iter_mut().for_each(|x| *x /= d_model);
        }
        worst = worst.max(max_abs_diff(&ours_logits, &theirs_logits));
        assert_eq!(argmax(&ours_logits), argmax(&theirs_logits), "greedy tokens differ after {prefix:?}");
        prefix.push(argmax(&ours_logits));
    }
    eprintln!("decoder logits difference from candle-transformers (gated: {gated}): {worst:e}");
    assert!(worst < 1e-4, "decoder logits differ by {worst}");
}

#[test]
fn t5_equals_candle_transformers_on_the_same_weights() {
    parity_with_candle_transformers(false);
}

#[test]
fn gated_untied_t5_equals_candle_transformers_on_the_same_weights() {
    parity_with_candle_transformers(true);
}

#[test]
fn batched_encoding_and_decoding_equal_one_at_a_time() {
    let dir = tiny_t5("t5-batched", false);
    let model = T5::load(&dir, &Device::Cpu).unwrap();
    let sources: [&[u32]; 3] = [SOURCE, &[5, 6, 1], &[30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 1]];
    let together = model.encode(&sources).unwrap();
    let mut alone_states = Vec::new();
    let mut worst = 0f32;
    for (i, source) in sources.iter().enumerate() {
        let alone = model.encode(&[source]).unwrap().remove(0);
        let (a, b) = (alone.flatten_all().unwrap().to_vec1::<f32>().unwrap(), together[i].flatten_all().unwrap().to_vec1::<f32>().unwrap());
        worst = worst.max(max_abs_diff(&a, &b));
        alone_states.push(model.start(&alone).unwrap());
    }
    let mut batch_states: Vec<_> = together.iter().map(|e| model.start(e).unwrap()).collect();
    // Twenty greedy steps (past the exact buckets), all three at once against each alone.
    let mut next = [0u32; 3];
    for _ in 0..20 {
        let batched = model.decode_step(&next, &mut batch_states.iter_mut().collect::<Vec<_>>()).unwrap();
        for i in 0..3 {
            let alone = model.decode_step(&[next[i]], &mut [&mut alone_states[i]]).unwrap().remove(0);
            worst = worst.max(max_abs_diff(&alone, &batched[i]));
            assert_eq!(argmax(&alone), argmax(&batched[i]));
        }
        for i in 0..3 {
            next[i] = argmax(&batched[i]);
        }
    }
    eprintln!("largest batched vs alone difference: {worst:e}");
    assert!(worst <= 1e-5, "batching changed a value by {worst}");
}

#[test]
fn seq2seq_job_runs_end_to_end_through_the_cli() {
    let dir = scratch("t5-job");
    let model = dir.join("t5");
    write_tiny_t5(&model, true);
    let ids: Vec<String> = (0..24).map(|i| format!("s{i:02}")).collect();
    let texts: Vec<String> = (0..24).map(|i| format!("summarise ticket the {} {} since morning", WORDS[i % 40], WORDS[(i * 7) % 50])).collect();
    let mut prompts: Vec<Option<&str>> = texts.iter().map(|t| Some(t.as_str())).collect();
    prompts[5] = None;
    write_parquet(&dir.join("in.parquet"), vec![("id", strings(&ids.iter().map(|s| Some(s.as_str())).collect::<Vec<_>>())), ("prompt", strings(&prompts))]);
    let job = dir.join("job.toml");
    let write_job_with = |out: &str, generation: &str| {
        std::fs::write(
            &job,
            format!(
                "kind = \"seq2seq\"\n[input]\nurl = {:?}\nid_column = \"id\"\n[model]\npath = {:?}\n[generation]\nmax_new_tokens = 10\n{generation}\n[output]\nurl = {:?}\nunit_rows = 10\n",
                dir.join("in.parquet").to_string_lossy(),
                model.to_string_lossy(),
                dir.join(out).to_string_lossy()
            ),
        )
        .unwrap();
    };
    let write_job = |out: &str| write_job_with(out, "");
    write_job("out");
    nightshift(&["run", job.to_str().unwrap(), "--max-seqs", "1"], &[]).assert_ok();
    let one = read_results(&dir.join("out"));
    write_job("out-batched");
    nightshift(&["run", job.to_str().unwrap(), "--max-seqs", "8"], &[]).assert_ok();
    let batched = read_results(&dir.join("out-batched"));
    assert_eq!(one.len(), 24);
    assert_eq!(one["s05"].error_code.as_deref(), Some("null_prompt"));
    for (id, row) in &one {
        let other = &batched[id];
        assert_eq!((&row.text, row.completion_tokens, &row.finish_reason), (&other.text, other.completion_tokens, &other.finish_reason), "{id}");
        if id != "s05" {
            assert_eq!(row.status, "succeeded");
            assert!(row.completion_tokens >= 1 && row.completion_tokens <= 10, "{row:?}");
            // The source's words plus `</s>`.
            assert_eq!(row.prompt_tokens, Some(texts[id[1..].parse::<usize>().unwrap()].split(' ').count() as u32 + 1));
        }
    }
    assert!(one.values().any(|r| r.text.as_deref().is_some_and(|t| !t.is_empty())), "some output has words");
    // Seeded sampling: each row's draw depends on (seed, id) only, not on its batch.
    let sampled = |out: &str, max_seqs: &str| {
        write_job_with(out, "temperature = 0.9\ntop_p = 0.95\nseed = 7");
        nightshift(&["run", job.to_str().unwrap(), "--max-seqs", max_seqs], &[]).assert_ok();
        read_results(&dir.join(out)).into_iter().map(|(id, r)| (id, r.text)).collect::<Vec<_>>()
    };
    let (a, b) = (sampled("sampled-1", "1"), sampled("sampled-8", "8"));
    assert_eq!(a, b);
    assert_ne!(a, one.iter().map(|(id, r)| (id.clone(), r.text.clone())).collect::<Vec<_>>(), "sampling differs from greedy");
    // A stop string ends a row where it first appears, and is not part of the output.
    let greedy = one["s00"].text.clone().unwrap();
    let word = greedy.split(' ').nth(2).expect("the greedy output has three words");
    let stop = format!(" {word}");
    write_job_with("stopped", &format!("stop = [{stop:?}]"));
    nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
    let stopped = &read_results(&dir.join("stopped"))["s00"];
    assert_eq!(stopped.text.as_deref(), Some(&greedy[..greedy.find(&stop).unwrap()]), "{greedy:?}");
    assert_eq!(stopped.finish_reason, "stop");
    write_job("out");
    // The job is resumable like any other: a rerun finds it complete; validate describes the model.
    let run = nightshift(&["run", job.to_str().unwrap()], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("complete already"), "{}", run.stdout);
    let run = nightshift(&["validate", job.to_str().unwrap()], &[]);
    run.assert_ok();
    assert!(run.stdout.contains("encoder-decoder (t5)"), "{}", run.stdout);
}

#[test]
fn the_sample_seq2seq_job_runs_on_a_t5_directory() {
    let dir = scratch("t5-sample-job");
    write_tiny_t5(&dir.join("t5"), true);
    let out = dir.join("out");
    let run = nightshift(
        &["run", "jobs/seq2seq.toml", "--model", dir.join("t5").to_str().unwrap(), "--output", out.to_str().unwrap(), "--show", "2"],
        &[],
    );
    run.assert_ok();
    let rows = read_results(&out);
    assert_eq!(rows.len(), 12);
    assert!(rows.values().all(|r| r.status == "succeeded" && r.completion_tokens >= 1), "{rows:?}");
}

/// A T5 small enough for the tests, of either layout, as `synth-model` writes the published ones.
fn tiny_shape(gated: bool) -> nightshift::synth::t5::T5Shape {
    nightshift::synth::t5::T5Shape { name: "tiny", vocab: 300, d_model: 64, d_kv: 16, heads: 4, d_ff: 128, layers: 2, decoder_layers: 2, gated, buckets: 32 }
}

/// nightshift's logits at every decoder position, teacher-forced: `source` encoded, `decoder` (the start token
/// first) fed a token at a time.
fn teacher_forced(model: &T5, source: &[u32], decoder: &[u32]) -> Vec<Vec<f32>> {
    let encoded = model.encode(&[source]).unwrap().remove(0);
    let mut state = model.start(&encoded).unwrap();
    decoder.iter().map(|&t| model.decode_step(&[t], &mut [&mut state]).unwrap().remove(0)).collect()
}

/// llama.cpp's logits (scripts/llama-peer.cpp) after each prefix of `decoder`, `source` encoded.
fn llama_cpp_teacher_forced(peer: &Path, gguf: &Path, source: &[u32], decoder: &[u32]) -> Vec<Vec<f32>> {
    let join = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let input: String = (1..=decoder.len()).map(|n| format!("!{}|{}\n", join(source), join(&decoder[..n]))).collect();
    let mut command = std::process::Command::new(peer);
    command.args(["--logits", gguf.to_str().unwrap()]);
    // The first line is the vocabulary's; then one line of logits per prefix.
    let out = crate::engine::llama_cpp::output_of(command, &input, &format!("llama.cpp on {}", gguf.display()));
    out.lines().skip(1).map(|l| l.split(' ').map(|x| x.parse().unwrap()).collect()).collect()
}

/// The largest difference over the position's largest logit, over every position; and the positions whose top
/// tokens differ.
fn relative_gap(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, usize) {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    let mut flips = 0;
    for (x, y) in a.iter().zip(b) {
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        worst = worst.max(max_abs_diff(x, y) / scale);
        flips += usize::from(argmax(x) != argmax(y));
    }
    (worst, flips)
}

#[test]
fn t5_gguf_files_compute_what_llama_cpp_and_their_safetensors_copies_compute() {
    use candle_core::quantized::GgmlDType;
    use nightshift::synth::t5::{t5_gguf, write_t5};
    // A 40-token source (past the 8 exact distances of each direction's buckets), 24 decoder positions.
    let source: Vec<u32> = (0..39).map(|i| 3 + (i * 53 % 297) as u32).chain([1]).collect();
    let peer = crate::tokenizer::llama_peer();
    for (gated, quant) in [(true, GgmlDType::F32), (true, GgmlDType::F16), (true, GgmlDType::Q8_0), (false, GgmlDType::F32)] {
        let dir = scratch(&format!("t5-gguf-{gated}-{quant:?}")).join("t5");
        let shape = tiny_shape(gated);
        write_t5(&dir, &shape, 11, true).unwrap();
        let (gguf, _) = t5_gguf(&dir, quant, None).unwrap();
        let from_gguf = T5::load(&gguf, &Device::Cpu).unwrap();
        let from_dir = T5::load(&dir, &Device::Cpu).unwrap();
        assert_eq!((from_gguf.config.feed_forward_proj.as_str(), from_gguf.config.tie_word_embeddings), (if gated { "gated-gelu" } else { "relu" }, !gated));
        // The decoder's input: the start token, then varied tokens (a random model's greedy output repeats a token,
        // and then the decoder's position bias has nothing to tell apart).
        let decoder: Vec<u32> = std::iter::once(0).chain((0..23).map(|i| 3 + (i * 89 % 297) as u32)).collect();
        let ours = teacher_forced(&from_gguf, &source, &decoder);
        let copy = teacher_forced(&from_dir, &source, &decoder);
        let (copy_gap, copy_flips) = relative_gap(&copy, &ours);
        eprintln!("gated {gated}, {quant:?}: GGUF against its safetensors copy {copy_gap:e}, {copy_flips} of {} top tokens differ", ours.len());
        if quant == GgmlDType::F32 {
            assert_eq!(copy_gap, 0.0, "an F32 GGUF computes exactly its safetensors copy");
        }
        assert!(copy_gap < 0.05 && copy_flips <= 1, "{quant:?}: {copy_gap}, {copy_flips}");
        let Some(peer) = &peer else { continue };
        let mut theirs = llama_cpp_teacher_forced(peer, &gguf, &source, &decoder);
        if !gated {
            // Tied embeddings: Hugging Face's T5 (and nightshift) scales the decoder's output by d_model^-0.5 before
            // the output projection; llama.cpp does not, so its logits are sqrt(d_model) times larger.
            let scale = (shape.d_model as f32).powf(-0.5);
            theirs.iter_mut().flatten().for_each(|x| *x *= scale);
        }
        let (gap, flips) = relative_gap(&ours, &theirs);
        eprintln!("gated {gated}, {quant:?}: against llama.cpp {gap:e} of the largest logit, {flips} of {} top tokens differ", ours.len());
        // Within the float types' rounding (llama.cpp keeps the decoder's keys and values in f16, computes GELU from
        // an f16 table); Q8_0 also within its activations' quantization, which llama.cpp adds (8 bits per value
        // per block of 32, as large as the weights'), so a near-tie may go the other way.
        let (tolerance, near_ties) = if quant == GgmlDType::Q8_0 { (3e-2, 1) } else { (5e-3, 0) };
        assert!(gap < tolerance && flips <= near_ties, "{quant:?}: {gap}, {flips}");
        if gated && quant == GgmlDType::F32 {
            // The check catches a model computed wrong: the same file without the decoder's relative-position bias.
            let broken = scratch("t5-gguf-broken").join("t5");
            write_t5(&broken, &shape, 11, true).unwrap();
            let mut tensors = candle_core::safetensors::load(broken.join("model.safetensors"), &Device::Cpu).unwrap();
            let bias = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
            let zeros = tensors[bias].zeros_like().unwrap();
            tensors.insert(bias.into(), zeros);
            candle_core::safetensors::save(&tensors, broken.join("model.safetensors")).unwrap();
            let wrong = teacher_forced(&T5::load(&broken, &Device::Cpu).unwrap(), &source, &decoder);
            let (gap, flips) = relative_gap(&wrong, &theirs);
            eprintln!("without the decoder's position bias: {gap:e}, {flips} top tokens differ");
            // Measured: 5.9e-2, 500 times the file's own 1.2e-4 (synth's T5 draws its sublayers' outputs a quarter
            // wide, so each layer weighs less in the logits than it once did: 0.23).
            assert!(gap > 0.02, "{gap}");
        }
    }
}

#[test]
fn a_seq2seq_job_on_a_t5_gguf_file_writes_what_its_directory_writes() {
    use nightshift::synth::t5::{t5_gguf, write_t5};
    let dir = scratch("t5-gguf-job");
    let model = dir.join("t5");
    write_t5(&model, &tiny_shape(true), 5, true).unwrap();
    let (gguf, _) = t5_gguf(&model, candle_core::quantized::GgmlDType::F32, None).unwrap();
    let ids: Vec<String> = (0..10).map(|i| format!("r{i}")).collect();
    // Pieces `▁w0` ...: words the vocabulary has, and one it has not (`<unk>`).
    let texts: Vec<String> = (0..10).map(|i| format!("w{} w{} w{} zebra w{}", i, i * 7 % 297, i * 13 % 297, 296 - i)).collect();
    write_parquet(&dir.join("in.parquet"), vec![("id", strings(&ids.iter().map(|s| Some(s.as_str())).collect::<Vec<_>>())), ("prompt", strings(&texts.iter().map(|t| Some(t.as_str())).collect::<Vec<_>>()))]);
    let run = |model: &Path, out: &str| {
        let job = dir.join(format!("{out}.toml"));
        std::fs::write(
            &job,
            format!(
                "kind = \"seq2seq\"\n[input]\nurl = {:?}\nid_column = \"id\"\n[model]\npath = {:?}\n[generation]\nmax_new_tokens = 12\n[output]\nurl = {:?}\n",
                dir.join("in.parquet").to_string_lossy(),
                model.to_string_lossy(),
                dir.join(out).to_string_lossy()
            ),
        )
        .unwrap();
        nightshift(&["run", job.to_str().unwrap()], &[]).assert_ok();
        let validate = nightshift(&["validate", job.to_str().unwrap()], &[]);
        validate.assert_ok();
        assert!(validate.stdout.contains("encoder-decoder (t5)"), "{}", validate.stdout);
        read_results(&dir.join(out))
    };
    let (from_dir, from_gguf) = (run(&model, "out-dir"), run(&gguf, "out-gguf"));
    assert_eq!(from_gguf.len(), 10);
    for (id, row) in &from_dir {
        let other = &from_gguf[id];
        assert_eq!(row.status, "succeeded", "{row:?}");
        // The same tokens in (the words, `<unk>`, `</s>`), the same tokens and text out.
        assert_eq!(row.prompt_tokens, Some(6), "{row:?}");
        assert_eq!((&row.text, row.completion_tokens, row.prompt_tokens), (&other.text, other.completion_tokens, other.prompt_tokens), "{id}");
    }
    assert!(from_gguf.values().any(|r| r.text.as_deref().is_some_and(|t| t.contains('w'))), "{from_gguf:?}");
    // The metrics say what was computed: F32 as stored; an F16 file's weights widened to f32.
    assert_eq!(read_metrics_text(&dir.join("out-gguf"))["weights_layout"], "as-stored");
    let (f16, _) = t5_gguf(&model, candle_core::quantized::GgmlDType::F16, None).unwrap();
    let rows = run(&f16, "out-f16");
    assert!(rows.values().all(|r| r.status == "succeeded"), "{rows:?}");
    assert_eq!(read_metrics_text(&dir.join("out-f16"))["weights_layout"], "widened to f32");
}

/// Teacher-forced fidelity of a T5 GGUF file against llama.cpp, on llama.cpp's own greedy continuations (what
/// `BENCHMARKS.md` reports): `NIGHTSHIFT_COMPARE_T5=FILE.gguf` (`NIGHTSHIFT_COMPARE_ROWS`, default 32 sources of
/// 16 to 63 random tokens and `</s>`; `NIGHTSHIFT_COMPARE_NEW`, default 32 tokens each), with the llama.cpp peer.
/// Prints the share of positions where nightshift's top token is llama.cpp's greedy one and the mean absolute
/// difference of that token's log-probability; and, where `model.safetensors` lies beside the file, the same for
/// the GGUF against that copy. `NIGHTSHIFT_COMPARE_T5_NIGHTSHIFT=OTHER.gguf`: nightshift scores with another file.
#[test]
#[ignore = "a measurement: NIGHTSHIFT_COMPARE_T5=FILE.gguf NIGHTSHIFT_LLAMA_PEER=... cargo test -- --ignored compare_a_t5_file --nocapture"]
fn compare_a_t5_file() {
    let (Some(path), Some(peer)) = (std::env::var_os("NIGHTSHIFT_COMPARE_T5").map(PathBuf::from), crate::tokenizer::llama_peer()) else {
        panic!("set NIGHTSHIFT_COMPARE_T5 and NIGHTSHIFT_LLAMA_PEER");
    };
    let env = |k: &str, default: usize| std::env::var(k).ok().map_or(default, |v| v.parse().unwrap());
    let (rows, new) = (env("NIGHTSHIFT_COMPARE_ROWS", 32), env("NIGHTSHIFT_COMPARE_NEW", 32));
    // A broken copy for nightshift to score with (scripts/break-gguf.py), llama.cpp answering with the good file.
    let ours_path = std::env::var_os("NIGHTSHIFT_COMPARE_T5_NIGHTSHIFT").map_or(path.clone(), PathBuf::from);
    let model = T5::load(&ours_path, &Device::Cpu).unwrap();
    let vocab = model.config.vocab_size as u64;
    let mut state = 0x9e3779b97f4a7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let sources: Vec<Vec<u32>> = (0..rows).map(|_| {
        let n = 16 + next() % 48;
        (0..n).map(|_| (3 + next() % (vocab - 3)) as u32).chain([model.config.eos_token_id as u32]).collect()
    }).collect();
    let input: String = sources.iter().map(|s| format!("!{}\n", s.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))).collect();
    let mut command = std::process::Command::new(&peer);
    command.args(["--greedy", &new.to_string(), path.to_str().unwrap()]);
    let text = crate::engine::llama_cpp::output_of(command, &input, &format!("llama.cpp on {}", path.display()));
    let continuations: Vec<(Vec<u32>, Vec<f64>)> = text
        .lines()
        .skip(1)
        .map(|l| {
            let (ids, lps) = l.split_once('\t').unwrap();
            (ids.split(' ').map(|x| x.parse().unwrap()).collect(), lps.split(' ').map(|x| x.parse().unwrap()).collect())
        })
        .collect();
    let log_softmax = |x: &[f32], t: u32| -> f64 {
        let max = x.iter().fold(f32::MIN, |m, &v| m.max(v)) as f64;
        let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
        x[t as usize] as f64 - max - sum.ln()
    };
    let copy = path.parent().map(|d| d.join("model.safetensors")).filter(|p| p.is_file()).map(|p| T5::load(p.parent().unwrap(), &Device::Cpu).unwrap());
    let (mut positions, mut agree, mut diff, mut copy_agree, mut copy_diff) = (0usize, 0usize, 0f64, 0usize, 0f64);
    for (source, (tokens, logprobs)) in sources.iter().zip(&continuations) {
        let decoder: Vec<u32> = std::iter::once(model.config.decoder_start() as u32).chain(tokens[..tokens.len() - 1].iter().copied()).collect();
        let ours = teacher_forced(&model, source, &decoder);
        let theirs = copy.as_ref().map(|c| teacher_forced(c, source, &decoder));
        for (i, (&token, &lp)) in tokens.iter().zip(logprobs).enumerate() {
            positions += 1;
            agree += usize::from(argmax(&ours[i]) == token);
            diff += (log_softmax(&ours[i], token) - lp).abs();
            if let Some(theirs) = &theirs {
                copy_agree += usize::from(argmax(&ours[i]) == argmax(&theirs[i]));
                copy_diff += (log_softmax(&ours[i], token) - log_softmax(&theirs[i], token)).abs();
            }
        }
    }
    let pct = |n: usize| 100.0 * n as f64 / positions as f64;
    println!("{} (nightshift: {}): {rows} sources, {positions} positions of llama.cpp's greedy continuations", path.display(), ours_path.display());
    println!("  against llama.cpp: top-1 agreement {:.1} %, mean |log-prob difference| {:.4}", pct(agree), diff / positions as f64);
    if copy.is_some() {
        println!("  against its safetensors copy: top-1 agreement {:.1} %, mean |log-prob difference| {:.4}", pct(copy_agree), copy_diff / positions as f64);
    }
}
