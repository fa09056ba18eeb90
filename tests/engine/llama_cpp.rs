//! Tiny GGUF models of every family nightshift reads from GGUF (llama, qwen2 with its biases, qwen3 with its q/k
//! norms and heads wider than hidden / heads), written by `synth`, computed by nightshift and by llama.cpp's forward
//! pass on the same file (scripts/llama-peer.cpp): the same logits within the rounding the two differ by. And the
//! same files' F32 and F16 weights computed by a float64 forward pass written from the architectures' definitions
//! (scripts/reference-forward.py): nightshift's arithmetic to within f32 rounding, which llama.cpp (an f16 KV cache, and
//! other rounding) cannot check.

use std::io::Write;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use nightshift::engine::{Attention, HostAttention, Model, Segment};
use nightshift::synth::{self, Family, Init, MoeShape, Shape, Spec, Vocabulary};

use crate::tokenizer::llama_peer;

const VOCABULARY: Vocabulary = Vocabulary { merges: &["Ġ t", "h e", "Ġ a"], size: 262, add_bos: false };

/// Token id sequences both compute: one token, a short prompt, and longer ones (RoPE at more positions).
fn sequences() -> Vec<Vec<u32>> {
    vec![vec![72], vec![259, 72, 101, 108, 108, 111], (0..23).map(|i| (i * 37 % 256) as u32).collect(), (0..61).map(|i| (i * 101 % 262) as u32).collect()]
}

/// What a program (the peer, the reference) prints for `input` on its standard input; a failure names `what`.
pub(crate) fn output_of(mut command: std::process::Command, input: &str, what: &str) -> String {
    let mut child = command
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The logits a program prints for each sequence (a line `!` and its ids in, a line of logits out), after its
/// first `skip` lines.
fn logits_from(command: std::process::Command, skip: usize, seqs: &[Vec<u32>], what: &str) -> Vec<Vec<f32>> {
    let input: String = seqs.iter().map(|s| format!("!{}\n", s.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))).collect();
    output_of(command, &input, what).lines().skip(skip).map(|l| l.split(' ').map(|x| x.parse().unwrap()).collect()).collect()
}

/// llama.cpp's logits at the last position of each sequence.
fn peer_logits(peer: &std::path::Path, model: &std::path::Path, seqs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut command = std::process::Command::new(peer);
    command.args(["--logits", model.to_str().unwrap()]);
    // The first line is the vocabulary's (size, specials); then one line of logits per sequence.
    logits_from(command, 1, seqs, &format!("llama.cpp on {}", model.display()))
}

fn nightshift_logits(model: &std::path::Path, seqs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let (model, _) = Model::load(model, &Device::Cpu).unwrap();
    let host = HostAttention::new(&model, DType::F32).unwrap();
    seqs.iter()
        .map(|tokens| {
            let mut cache = host.new_cache(tokens.len() + 1);
            model.forward(&host, &mut [Segment { tokens, cache: &mut cache }]).unwrap().remove(0)
        })
        .collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold((0, f32::MIN), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0
}

/// The largest difference over the largest logit, and whether the argmax agrees, over every sequence.
fn compare(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, bool) {
    let mut worst = 0f32;
    let mut same = true;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        worst = worst.max(x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale);
        same &= argmax(x) == argmax(y);
    }
    (worst, same)
}

/// Where `b`'s argmax is not `a`'s, how far below `a`'s top logit `a` puts `b`'s choice, over the largest logit (the
/// largest over every sequence; 0 where they agree): a choice within the rounding the two differ by is a near-tie,
/// not a wrong model.
fn choice_gap(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            (x[argmax(x)] - x[argmax(y)]) / scale
        })
        .fold(0f32, f32::max)
}

/// The families nightshift reads from GGUF, as the tests write them: (family, head size, tied embeddings). qwen3's
/// and gemma3's heads are wider than hidden / heads.
pub(super) const FAMILIES: [(Family, usize, bool); 10] = [
    (Family::Llama, 16, false),
    (Family::Qwen2, 16, true),
    (Family::Qwen3, 24, true),
    (Family::Gemma2, 16, true),
    (Family::Gemma3, 24, true),
    (Family::Phi3, 16, false),
    (Family::Mixtral, 16, false),
    (Family::Qwen3Moe, 24, false),
    (Family::Qwen2Moe, 16, false),
    (Family::Olmoe, 16, false),
];

/// The global RoPE base the tests' models have: Gemma 3's local layers have their own, 10,000.
pub(super) fn rope_theta(family: Family) -> u32 {
    if family == Family::Gemma3 { 1_000_000 } else { 10000 }
}

/// A tiny model of a family. Gemma's slide over 16 positions (less than the longer sequences): Gemma 2 in layer 0
/// of 2, Gemma 3 in layers 0 to 4 of 6, whose local layers rotate with a base of 10,000 when the global one is
/// `rope_theta`.
pub(crate) fn spec(family: Family, head_dim: usize, tied: bool, rope_theta: u32) -> Spec {
    let shape = Shape {
        name: "tiny-family",
        family,
        hidden: 64,
        layers: if family == Family::Gemma3 { 6 } else { 2 },
        heads: 4,
        // OLMoE's k norm spans the whole k row, as wide as q's in its files (llama.cpp's takes `n_embd` values).
        kv_heads: if family == Family::Olmoe { 4 } else { 2 },
        head_dim,
        intermediate: 128,
        vocab: VOCABULARY.size,
        context: 256,
        rope_theta,
        rope_scaling: None,
        tied,
        sliding_window: family.is_gemma().then_some(16),
        // Mixtral's 8 experts, 2 per token; Qwen3-MoE's many (16 here), 4 per token, narrower than the dense width.
        moe: match family {
            Family::Mixtral => Some(MoeShape { experts: 8, used: 2, intermediate: 128, shared: None }),
            Family::Qwen3Moe => Some(MoeShape { experts: 16, used: 4, intermediate: 64, shared: None }),
            // Qwen2-MoE's 60 experts and 4 per token in small, and a shared expert four times an expert's width.
            Family::Qwen2Moe => Some(MoeShape { experts: 12, used: 4, intermediate: 32, shared: Some(128) }),
            // OLMoE's 64 experts and 8 per token in small.
            Family::Olmoe => Some(MoeShape { experts: 16, used: 4, intermediate: 32, shared: None }),
            _ => None,
        },
        rotary_dim: None,
    };
    Spec { shape, vocabulary: VOCABULARY, dtype: DType::F32, init: Init::Fidelity, seed: 7 }
}

/// qwen2's q, k and v biases and qwen3's per-head q and k norms run in the host layer loop too (an f32 model on the
/// CPU whose matrices are the kernels'), with the tensor loop's bits; so do llama's layers.
#[test]
fn every_gguf_family_runs_the_host_layer_loop_with_the_tensor_loops_bits() {
    let dir = crate::support::scratch("gguf-families-host-loop");
    for (family, head_dim, tied) in FAMILIES {
        for quant in [GgmlDType::Q8_0, GgmlDType::F16] {
            let path = dir.join(format!("{family:?}-{quant:?}.gguf"));
            synth::write_gguf(&path, &spec(family, head_dim, tied, rope_theta(family)), quant).unwrap();
            super::the_two_layer_loops_agree(&path, &[5, 17, 200, 3, 99, 250], &[7, 8, 9, 10, 11, 12, 13, 14, 15]);
        }
    }
}

/// The largest logit difference allowed with F16 weights, over the largest logit: measured 1.7e-4 to 7.6e-4 (Q8_0:
/// 4.1e-3 to 1.1e-2, allowed 4e-2).
const F16_TOLERANCE: f32 = 2e-3;

/// The same for Gemma, whose GELU llama.cpp computes from a table indexed by the input rounded to f16 (nightshift
/// and the float64 reference from the input itself: they agree to 2e-6): measured F16 1.8e-3 to 2.7e-3, Q8_0 2.2e-2
/// to 4.2e-2.
const GEMMA_TOLERANCES: (f32, f32) = (6e-2, 6e-3);

#[test]
fn gguf_families_compute_what_llama_cpp_computes() {
    let Some(peer) = llama_peer() else { return };
    let dir = crate::support::scratch("gguf-families-llama-cpp");
    let seqs = sequences();
    // Q8_0 matrices (both quantize the activations to Q8_0 per block of 32, as llama.cpp defines it) and F16 ones
    // (llama.cpp rounds activations to f16 for them, nightshift keeps f32); llama.cpp's KV cache is f16.
    for (family, head_dim, tied) in FAMILIES {
        let (q8, f16) = if family.is_gemma() { GEMMA_TOLERANCES } else { (0.04, F16_TOLERANCE) };
        for (quant, tolerance) in [(GgmlDType::Q8_0, q8), (GgmlDType::F16, f16)] {
            let path = dir.join(format!("{family:?}-{quant:?}.gguf"));
            synth::write_gguf(&path, &spec(family, head_dim, tied, rope_theta(family)), quant).unwrap();
            let (theirs, ours) = (peer_logits(&peer, &path, &seqs), nightshift_logits(&path, &seqs));
            let (diff, same) = compare(&theirs, &ours);
            let gap = choice_gap(&theirs, &ours);
            eprintln!("{family:?} {quant:?}: largest difference {diff} of the largest logit; argmax agrees: {same} (else within {gap})");
            // The argmax agrees; for Gemma, whose tiny Gemma 3 Q8_0 has a near-tie (1.6 % of the largest logit), a
            // choice within the tolerance of llama.cpp's top logit passes too; for the mixtures of experts (the tiny
            // Mixtral Q8_0 has one at 0.23 %), a choice closer to llama.cpp's than the largest difference measured.
            let moe = matches!(family, Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe);
            let agrees = same || (family.is_gemma() && gap <= tolerance) || (moe && gap <= diff);
            assert!(diff <= tolerance && agrees, "{family:?} {quant:?}: largest difference {diff} of the largest logit, argmax agrees: {same} (else within {gap})");
        }
    }
    // The comparison catches a model computed wrongly: RoPE's base 10,000 in llama.cpp's file, 20,000 in
    // nightshift's (the same weights otherwise).
    let good = dir.join("qwen2-good.gguf");
    let bad = dir.join("qwen2-rope.gguf");
    synth::write_gguf(&good, &spec(Family::Qwen2, 16, true, 10000), GgmlDType::F16).unwrap();
    synth::write_gguf(&bad, &spec(Family::Qwen2, 16, true, 20000), GgmlDType::F16).unwrap();
    let (diff, _) = compare(&peer_logits(&peer, &good, &seqs), &nightshift_logits(&bad, &seqs));
    assert!(diff > 2.0 * F16_TOLERANCE, "a wrong RoPE base went unnoticed: {diff}");
}

/// A copy of a GGUF file with some metadata keys set to other values (the tensors as they are).
fn with_keys(from: &std::path::Path, to: &std::path::Path, keys: &[(&str, candle_core::quantized::gguf_file::Value)]) {
    rewrite(from, to, keys, &[]);
}

/// A copy of a GGUF file with some metadata keys set to other values and some F32 vectors added as tensors.
fn rewrite(from: &std::path::Path, to: &std::path::Path, keys: &[(&str, candle_core::quantized::gguf_file::Value)], vectors: &[(&str, &[f32])]) {
    use candle_core::quantized::gguf_file::{Content, Value};
    let mut file = std::fs::File::open(from).unwrap();
    let content = Content::read(&mut file).unwrap();
    let mut metadata: Vec<(String, Value)> = content.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (key, value) in keys {
        metadata.retain(|(k, _)| k != key);
        metadata.push((key.to_string(), value.clone()));
    }
    let mut tensors: Vec<(String, candle_core::quantized::QTensor)> =
        content.tensor_infos.keys().map(|name| (name.clone(), content.tensor(&mut file, name, &Device::Cpu).unwrap())).collect();
    for (name, values) in vectors {
        let t = candle_core::Tensor::from_slice(values, values.len(), &Device::Cpu).unwrap();
        tensors.push((name.to_string(), candle_core::quantized::QTensor::quantize(&t, GgmlDType::F32).unwrap()));
    }
    let mut out = std::fs::File::create(to).unwrap();
    let meta: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    candle_core::quantized::gguf_file::write(&mut out, &meta, &tensors).unwrap();
}

/// The comparison with llama.cpp catches a Gemma computed without one of its operations: nightshift computing a
/// copy of the file whose keys switch the operation off (a soft-cap of 1e9 is none; a window as long as the
/// context, full attention; Gemma 3's local RoPE base set to the global one) against llama.cpp on the file itself.
/// The attention soft-cap is set to 5 in the file first: at Gemma 2's 50 it hardly touches the tiny model's scores.
#[test]
fn gemma_computed_without_one_of_its_operations_is_caught() {
    use candle_core::quantized::gguf_file::Value;
    let Some(peer) = llama_peer() else { return };
    let dir = crate::support::scratch("gemma-broken-variants");
    let seqs = sequences();
    let cases: [(Family, &str, Option<Value>, Value); 4] = [
        (Family::Gemma2, "gemma2.final_logit_softcapping", None, Value::F32(1e9)),
        (Family::Gemma2, "gemma2.attn_logit_softcapping", Some(Value::F32(5.0)), Value::F32(1e9)),
        (Family::Gemma2, "gemma2.attention.sliding_window", None, Value::U32(256)),
        (Family::Gemma3, "gemma3.rope.freq_base_swa", None, Value::F32(1e6)),
    ];
    for (family, key, set, off) in cases {
        let head_dim = if family == Family::Gemma3 { 24 } else { 16 };
        let written = dir.join(format!("{key}-written.gguf"));
        synth::write_gguf(&written, &spec(family, head_dim, true, rope_theta(family)), GgmlDType::F16).unwrap();
        let good = dir.join(format!("{key}-good.gguf"));
        with_keys(&written, &good, &set.map(|v| vec![(key, v)]).unwrap_or_default());
        let broken = dir.join(format!("{key}-off.gguf"));
        with_keys(&good, &broken, &[(key, off)]);
        let theirs = peer_logits(&peer, &good, &seqs);
        let (same_file, _) = compare(&theirs, &nightshift_logits(&good, &seqs));
        let (diff, _) = compare(&theirs, &nightshift_logits(&broken, &seqs));
        eprintln!("{key} off: {diff} of the largest logit (the file as written: {same_file})");
        assert!(same_file <= GEMMA_TOLERANCES.1 && diff > 4.0 * GEMMA_TOLERANCES.1, "{key} off went unnoticed: {diff}");
    }
}

/// The comparison with llama.cpp catches a mixture of experts computed wrongly: nightshift computing a copy of the
/// file without renormalizing the chosen experts' weights (`expert_weights_norm` false; for Qwen2-MoE, which does not
/// renormalize, true), or routing each token to one expert more than the file says, against llama.cpp on the file
/// itself. Measured: 4.6e-2 to 6.8e-2 of the
/// largest logit, against 3e-4 to 4.5e-4 for the file as written.
#[test]
fn a_mixture_of_experts_computed_wrongly_is_caught() {
    use candle_core::quantized::gguf_file::Value;
    let Some(peer) = llama_peer() else { return };
    let dir = crate::support::scratch("moe-broken-variants");
    let seqs = sequences();
    let cases: [(Family, &str, Value); 6] = [
        (Family::Mixtral, "llama.expert_weights_norm", Value::Bool(false)),
        (Family::Mixtral, "llama.expert_used_count", Value::U32(3)),
        (Family::Qwen3Moe, "qwen3moe.expert_weights_norm", Value::Bool(false)),
        (Family::Qwen3Moe, "qwen3moe.expert_used_count", Value::U32(5)),
        // Qwen2-MoE's weights renormalized, which its family does not do.
        (Family::Qwen2Moe, "qwen2moe.expert_weights_norm", Value::Bool(true)),
        // OLMoE's likewise.
        (Family::Olmoe, "olmoe.expert_weights_norm", Value::Bool(true)),
    ];
    for (family, key, off) in cases {
        let head_dim = if family == Family::Qwen3Moe { 24 } else { 16 };
        let good = dir.join(format!("{key}-good.gguf"));
        // Peaked, a router of gain 4: the chosen experts' probabilities short of 1 by enough for renormalizing to
        // show (fidelity's gain of 16 leaves the top expert nearly all of it).
        let spec = Spec { init: Init::Peaked, ..spec(family, head_dim, false, rope_theta(family)) };
        synth::write_gguf(&good, &spec, GgmlDType::F16).unwrap();
        let broken = dir.join(format!("{key}-off.gguf"));
        with_keys(&good, &broken, &[(key, off)]);
        let theirs = peer_logits(&peer, &good, &seqs);
        let (same_file, _) = compare(&theirs, &nightshift_logits(&good, &seqs));
        let (diff, _) = compare(&theirs, &nightshift_logits(&broken, &seqs));
        eprintln!("{key} changed: {diff} of the largest logit (the file as written: {same_file})");
        assert!(same_file <= F16_TOLERANCE && diff > 4.0 * F16_TOLERANCE, "{key} changed went unnoticed: {diff}");
    }
}

/// Phi-3's LongRoPE (its 128k-context models, Phi-3.5) as llama.cpp computes it: a tiny Phi-3 with long and short
/// factors (as llama.cpp's converter writes them), its context (256) past a pre-trained one of 32, so the long
/// factors and an attention factor of sqrt(1 + ln 8 / ln 32) apply; and with a pre-trained context of 512, the short
/// ones. Against llama.cpp on the sequences its context choice agrees on (the peer's context is the sequence's
/// length and 16, long past 32 for the two longer ones); the factors change what the model computes; and the Hugging
/// Face copy (`rope_scaling` of type `longrope`) computes what the GGUF file does.
#[test]
fn phi3_long_rope_computes_what_llama_cpp_computes() {
    use candle_core::quantized::gguf_file::Value;
    let Some(peer) = llama_peer() else { return };
    let dir = crate::support::scratch("phi3-longrope");
    let spec = spec(Family::Phi3, 16, false, 10000);
    let written = dir.join("phi3.gguf");
    synth::write_gguf(&written, &spec, GgmlDType::F32).unwrap();
    let long: Vec<f32> = (0..8).map(|i| 1.0 + 0.9 * i as f32).collect();
    let short: Vec<f32> = (0..8).map(|i| 1.0 + 0.1 * i as f32).collect();
    let plain = nightshift_logits(&written, &sequences());
    for (original, is_long) in [(32usize, true), (512, false)] {
        let attn_factor = if is_long { (1.0 + (256.0 / original as f64).ln() / (original as f64).ln()).sqrt() as f32 } else { 1.0 };
        let path = dir.join(format!("phi3-longrope-{original}.gguf"));
        let keys = [("phi3.rope.scaling.original_context_length", Value::U32(original as u32)), ("phi3.rope.scaling.attn_factor", Value::F32(attn_factor))];
        rewrite(&written, &path, &keys, &[("rope_factors_long.weight", &long), ("rope_factors_short.weight", &short)]);
        let config = Model::load(&path, &Device::Cpu).unwrap().0.config;
        assert_eq!(config.long_rope.as_ref().map(|l| (l.long, l.original_context)), Some((is_long, original)));
        let seqs: Vec<Vec<u32>> = sequences().into_iter().filter(|s| (s.len() + 16 > original) == is_long).collect();
        let ours = nightshift_logits(&path, &seqs);
        let (diff, same) = compare(&peer_logits(&peer, &path, &seqs), &ours);
        eprintln!("Phi-3 LongRoPE, pre-trained context {original}: {diff} of the largest logit from llama.cpp on {} sequences", seqs.len());
        assert!(diff <= F16_TOLERANCE && same, "LongRoPE ({original}): {diff}");
        let (changed, _) = compare(&plain[plain.len() - seqs.len()..], &ours);
        assert!(changed > 4.0 * F16_TOLERANCE, "the factors changed nothing: {changed}");
        if is_long {
            // The Hugging Face copy, its factors and pre-trained context in config.json.
            let hf = dir.join("phi3-hf");
            synth::write_hf(&hf, &spec).unwrap();
            let config_path = hf.join("config.json");
            let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
            json["rope_scaling"] = serde_json::json!({"type": "longrope", "long_factor": long, "short_factor": short});
            json["original_max_position_embeddings"] = original.into();
            std::fs::write(&config_path, json.to_string()).unwrap();
            let hf_config = Model::load(&hf, &Device::Cpu).unwrap().0.config;
            assert_eq!(hf_config.long_rope, config.long_rope, "the two copies' LongRoPE");
            let (diff, same) = compare(&nightshift_logits(&path, &sequences()), &nightshift_logits(&hf, &sequences()));
            assert!(diff <= 1e-5 && same, "LongRoPE's safetensors and GGUF copies: {diff}");
        }
    }
}

/// Partial rotary (Phi-4-mini: RoPE on 96 of each head's 128 values, the rest unrotated) as llama.cpp computes it
/// from `rope.dimension_count`: a tiny Phi-3 rotating 8 of each head's 16 values, alone and with LongRoPE's factors (one
/// per rotated pair, as Phi-4-mini has them; the short set at a pre-trained context of 512), and a Gemma 3 rotating 16
/// of 24 (its per-head q and k norms reordered with the rows). Against llama.cpp; rotating whole heads instead is
/// caught; the Hugging Face copy (`partial_rotary_factor`) computes what the GGUF file does; and a Qwen3 file that
/// rotates part of its heads is refused, as llama.cpp refuses it.
#[test]
fn partial_rotary_computes_what_llama_cpp_computes() {
    use candle_core::quantized::gguf_file::Value;
    let Some(peer) = llama_peer() else { return };
    let dir = crate::support::scratch("partial-rotary");
    let seqs = sequences();
    let short: Vec<f32> = (0..4).map(|i| 1.0 + 0.3 * i as f32).collect();
    for (family, head_dim, rotated, long_rope) in [(Family::Phi3, 16, 8, false), (Family::Phi3, 16, 8, true), (Family::Gemma3, 24, 16, false)] {
        let whole = spec(family, head_dim, false, rope_theta(family));
        let spec = Spec { shape: Shape { rotary_dim: Some(rotated), ..whole.shape }, ..whole };
        let name = format!("{family:?}-{rotated}-of-{head_dim}{}", if long_rope { "-longrope" } else { "" });
        let written = dir.join(format!("{name}-written.gguf"));
        synth::write_gguf(&written, &spec, GgmlDType::F32).unwrap();
        let path = dir.join(format!("{name}.gguf"));
        match long_rope {
            true => {
                let keys = [("phi3.rope.scaling.original_context_length", Value::U32(512)), ("phi3.rope.scaling.attn_factor", Value::F32(1.0))];
                rewrite(&written, &path, &keys, &[("rope_factors_long.weight", &short), ("rope_factors_short.weight", &short)]);
            }
            false => std::fs::rename(&written, &path).unwrap(),
        }
        let config = Model::load(&path, &Device::Cpu).unwrap().0.config;
        assert_eq!((config.head_dim, config.rotary_dim, config.long_rope.is_some()), (head_dim, rotated, long_rope));
        let ours = nightshift_logits(&path, &seqs);
        let (diff, same) = compare(&peer_logits(&peer, &path, &seqs), &ours);
        eprintln!("{name}: {diff} of the largest logit from llama.cpp");
        assert!(diff <= F16_TOLERANCE && same, "{name}: {diff}");
        if long_rope {
            continue;
        }
        // Whole heads rotated: another function.
        let all = dir.join(format!("{name}-whole.gguf"));
        synth::write_gguf(&all, &whole, GgmlDType::F32).unwrap();
        let (changed, _) = compare(&nightshift_logits(&all, &seqs), &ours);
        assert!(changed > 4.0 * F16_TOLERANCE, "{name}: rotating whole heads changed nothing: {changed}");
        if family == Family::Phi3 {
            let hf = dir.join(format!("{name}-hf"));
            synth::write_hf(&hf, &spec).unwrap();
            let hf_config = Model::load(&hf, &Device::Cpu).unwrap().0.config;
            assert_eq!(hf_config.rotary_dim, rotated, "partial_rotary_factor read");
            let (diff, same) = compare(&ours, &nightshift_logits(&hf, &seqs));
            assert!(diff <= 1e-5 && same, "{name}: the safetensors and GGUF copies: {diff}");
        }
    }
    let qwen3 = spec(Family::Qwen3, 24, false, 10000);
    let path = dir.join("qwen3-partial.gguf");
    synth::write_gguf(&path, &Spec { shape: Shape { rotary_dim: Some(16), ..qwen3.shape }, ..qwen3 }, GgmlDType::F32).unwrap();
    let error = Model::load(&path, &Device::Cpu).err().expect("refused").to_string();
    assert!(error.contains("qwen3.rope.dimension_count") && error.contains("whole heads"), "{error}");
}

/// Gemma's, Phi-3's and the mixtures of experts' Hugging Face checkpoints (Gemma's norm weights stored as `w`, llama's
/// names for other norms, sliding layers and soft-caps from config.json; Phi-3's fused matrices and its window over
/// every layer; Mixtral's and Qwen3-MoE's routers and experts, one tensor per expert's matrix) compute
/// what the same weights compute from GGUF (as llama.cpp's converter writes them), in f32 and in bf16 safetensors.
/// Measured: the same logits, bit for bit (the same f32 weights and kernels). The windowed Phi-3 also computes the
/// float64 reference's function (llama.cpp switches Phi's window off, so it is no reference there).
#[test]
fn gemma_phi3_and_moe_safetensors_and_gguf_copies_agree() {
    let dir = crate::support::scratch("gemma-hf-gguf");
    let seqs = sequences();
    for (family, head_dim, tied) in FAMILIES.into_iter().filter(|f| f.0.is_gemma() || matches!(f.0, Family::Phi3 | Family::Mixtral | Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe)) {
        for dtype in [DType::F32, DType::BF16] {
            let mut spec = Spec { dtype, ..spec(family, head_dim, tied, rope_theta(family)) };
            if family == Family::Phi3 {
                spec.shape.sliding_window = Some(16);
            }
            let hf = dir.join(format!("{family:?}-{dtype:?}"));
            synth::write_hf(&hf, &spec).unwrap();
            let gguf = dir.join(format!("{family:?}-{dtype:?}.gguf"));
            synth::write_gguf(&gguf, &spec, GgmlDType::F32).unwrap();
            let (hf_model, _) = Model::load(&hf, &Device::Cpu).unwrap();
            let gguf_config = Model::load(&gguf, &Device::Cpu).unwrap().0.config;
            let config = |c: &nightshift::engine::models::llama::ModelConfig| (c.gemma.clone(), c.sliding.clone(), c.moe.clone(), c.ffn_size);
            assert_eq!(config(&hf_model.config), config(&gguf_config), "{family:?}: the two files' configurations");
            let (diff, same) = compare(&nightshift_logits(&gguf, &seqs), &nightshift_logits(&hf, &seqs));
            eprintln!("{family:?} {dtype:?}: safetensors against GGUF, {diff} of the largest logit");
            assert!(diff <= 1e-5 && same, "{family:?} {dtype:?}: {diff}");
            if family == Family::Phi3 && dtype == DType::F32 && llama_peer().is_some() {
                assert!(hf_model.config.sliding.is_some(), "Phi-3's window is read");
                let (diff, same) = compare(&reference_logits(&gguf, &seqs), &nightshift_logits(&gguf, &seqs));
                eprintln!("Phi3 with a window of 16: {diff} of the largest logit from the float64 reference");
                assert!(diff <= REFERENCE_TOLERANCE && same, "windowed Phi-3: {diff}");
                // And the window changes what the longer sequences compute.
                let full = dir.join("phi3-no-window.gguf");
                synth::write_gguf(&full, &Spec { shape: Shape { sliding_window: None, ..spec.shape }, ..spec }, GgmlDType::F32).unwrap();
                let (diff, _) = compare(&nightshift_logits(&full, &seqs), &nightshift_logits(&gguf, &seqs));
                assert!(diff > 100.0 * REFERENCE_TOLERANCE, "the window changed nothing: {diff}");
            }
        }
    }
}

#[test]
fn synth_models_load_and_tokenize_in_llama_cpp_as_in_nightshift() {
    let Some(peer) = llama_peer() else { return };
    let dir = crate::support::scratch("synth-gguf-llama-cpp");
    let path = dir.join("tiny.gguf");
    synth::write_gguf(&path, &spec(Family::Llama, 16, false, 10000), GgmlDType::Q4_1).unwrap();
    // llama.cpp reads synth's byte-level vocabulary (with merges, and a typed empty merge list too) as nightshift does.
    let texts = ["hello there", "<|im_start|>user\nthe tea<|im_end|>", "\u{00e9}t\u{00e9} 2026"];
    let input: String = texts.iter().map(|t| format!("{}\n", t.bytes().map(|b| format!("{b:02x}")).collect::<String>())).collect();
    // `synth-model` with Llama 2's SentencePiece vocabulary (llama.cpp's file), through the command line.
    let spm_dir = dir.join("spm");
    let vocab = crate::support::repo().join("models/llama.cpp/models/ggml-vocab-llama-spm.gguf");
    crate::support::nightshift(&["synth-model", spm_dir.to_str().unwrap(), "--shape", "tiny", "--vocab", vocab.to_str().unwrap(), "--gguf", "q8_0", "--init", "fidelity"], &[]).assert_ok();
    for file in [path.clone(), {
        let p = dir.join("no-merges.gguf");
        let spec = Spec { vocabulary: Vocabulary { merges: &[], ..VOCABULARY }, ..spec(Family::Llama, 16, false, 10000) };
        synth::write_gguf(&p, &spec, GgmlDType::Q8_0).unwrap();
        p
    }, spm_dir.join("model-q8_0.gguf")] {
        let mut child = std::process::Command::new(&peer)
            .arg(&file)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "llama.cpp refuses {}: {}", file.display(), String::from_utf8_lossy(&out.stderr));
        let theirs = String::from_utf8(out.stdout).unwrap();
        let vocab = nightshift::engine::models::llama::gguf::vocabulary(&file).unwrap();
        let vocab = vocab.gguf.as_deref().unwrap();
        // The whole model loads in nightshift too.
        Model::load(&file, &Device::Cpu).unwrap();
        let mut lines = theirs.lines();
        let header = lines.next().unwrap();
        assert!(crate::tokenizer::same_header(&nightshift::cli::peer_header(vocab), header), "{header}");
        for (line, expected) in input.lines().zip(lines) {
            assert_eq!(nightshift::cli::peer_line(vocab, line).unwrap(), expected, "{}", file.display());
        }
    }
}

/// The logits of a float64 forward pass written from the architectures' definitions (scripts/reference-forward.py,
/// numpy) at the last position of each sequence.
fn reference_logits(model: &std::path::Path, seqs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let repo = crate::support::repo();
    let mut command = std::process::Command::new("python3");
    command.arg(repo.join("scripts/reference-forward.py")).arg(model).env("PYTHONPATH", repo.join("models/llama.cpp/gguf-py"));
    let what = format!("the reference on {} (numpy and models/llama.cpp/gguf-py, which scripts/test.sh provides)", model.display());
    logits_from(command, 0, seqs, &what)
}

/// The largest logit difference from the float64 reference allowed, over the largest logit, for F32 and F16 weights
/// (which nightshift computes with f32 activations and an f32 KV cache): measured 1.0e-7 to 3.8e-7. llama.cpp (an f16
/// KV cache, and other rounding) is 5e-5 to 2e-4 from the reference on one layer.
const REFERENCE_TOLERANCE: f32 = 1e-5;

#[test]
fn gguf_families_compute_the_reference_function_in_f32() {
    // The reference needs what scripts/test.sh provides with the peer (numpy, llama.cpp's gguf-py).
    let Some(_) = llama_peer() else { return };
    let dir = crate::support::scratch("gguf-families-reference");
    let seqs = sequences();
    for (family, head_dim, tied) in FAMILIES {
        for quant in [GgmlDType::F32, GgmlDType::F16] {
            let path = dir.join(format!("{family:?}-{quant:?}.gguf"));
            synth::write_gguf(&path, &spec(family, head_dim, tied, rope_theta(family)), quant).unwrap();
            let (diff, same) = compare(&reference_logits(&path, &seqs), &nightshift_logits(&path, &seqs));
            eprintln!("{family:?} {quant:?}: largest difference from the reference {diff} of the largest logit");
            assert!(diff <= REFERENCE_TOLERANCE && same, "{family:?} {quant:?}: largest difference {diff} of the largest logit, argmax agrees: {same}");
        }
    }
    // A change far below what the comparison with llama.cpp can see (2e-3) is caught: RoPE's base 10,000 against
    // 10,010.
    let good = dir.join("llama-good.gguf");
    let bad = dir.join("llama-rope.gguf");
    synth::write_gguf(&good, &spec(Family::Llama, 16, false, 10000), GgmlDType::F32).unwrap();
    synth::write_gguf(&bad, &spec(Family::Llama, 16, false, 10010), GgmlDType::F32).unwrap();
    let (diff, _) = compare(&reference_logits(&good, &seqs), &nightshift_logits(&bad, &seqs));
    eprintln!("RoPE base 10,010 for 10,000: {diff} of the largest logit");
    assert!(diff > 10.0 * REFERENCE_TOLERANCE, "a RoPE base 0.1 % off went unnoticed: {diff}");
}

/// SmolLM2's Q4_1 file with F16, BF16 and Q8_0 matrices mixed in (as llama.cpp's mixes store them): the same
/// logits as llama.cpp computes from it, and the same argmax. Measured on a Sapphire Rapids Xeon: 0.034 of the
/// largest logit (the file as shipped, all Q4_1: 0.039; both quantize activations to 8 bits, with other rounding).
#[test]
fn a_file_of_mixed_types_computes_what_llama_cpp_computes() {
    let Some(peer) = llama_peer() else { return };
    let path = super::mixed_types_model();
    let seqs = vec![super::A.to_vec(), super::A.iter().chain(super::B).copied().collect()];
    let (diff, same) = compare(&peer_logits(&peer, &path, &seqs), &nightshift_logits(&path, &seqs));
    eprintln!("mixed types: largest difference {diff} of the largest logit");
    assert!(diff <= 0.06 && same, "mixed types: largest difference {diff} of the largest logit, argmax agrees: {same}");
}

/// A diagnosis, not a check: the GGUF file `NIGHTSHIFT_COMPARE_MODEL` names, computed by nightshift, by llama.cpp
/// and (with `NIGHTSHIFT_COMPARE_REFERENCE=1`; slow, and float64 weights in memory) by the float64 reference, on the
/// tests' sequences: the largest differences and whether the argmax agrees.
/// `NIGHTSHIFT_COMPARE_MODEL=F.gguf cargo test --test integration -- --ignored compare_a_file --nocapture`
#[test]
#[ignore = "a diagnosis of the file NIGHTSHIFT_COMPARE_MODEL names"]
fn compare_a_file_with_llama_cpp_and_the_reference() {
    let (Some(peer), Some(path)) = (llama_peer(), std::env::var_os("NIGHTSHIFT_COMPARE_MODEL")) else { return };
    let path = std::path::PathBuf::from(path);
    // The tests' sequences and a long one, or the lines of ids (space-separated) of `NIGHTSHIFT_COMPARE_SEQUENCES`.
    let seqs: Vec<Vec<u32>> = match std::env::var_os("NIGHTSHIFT_COMPARE_SEQUENCES") {
        Some(file) => std::fs::read_to_string(file).unwrap().lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect(),
        None => sequences().into_iter().chain([(0..300).map(|i| (i * 53 % 251 + 3) as u32).collect()]).collect(),
    };
    let ours = nightshift_logits(&path, &seqs);
    let theirs = peer_logits(&peer, &path, &seqs);
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let (diff, same) = compare(std::slice::from_ref(b), std::slice::from_ref(a));
        eprintln!("sequence {i} ({} tokens): nightshift against llama.cpp {diff:e} of the largest logit, argmax agrees: {same} ({} and {})", seqs[i].len(), argmax(a), argmax(b));
    }
    if std::env::var_os("NIGHTSHIFT_COMPARE_REFERENCE").is_some() {
        let reference = reference_logits(&path, &seqs);
        for (i, r) in reference.iter().enumerate() {
            let (ns, ns_same) = compare(std::slice::from_ref(r), std::slice::from_ref(&ours[i]));
            let (lc, lc_same) = compare(std::slice::from_ref(r), std::slice::from_ref(&theirs[i]));
            eprintln!("sequence {i}: from the float64 reference, nightshift {ns:e} ({ns_same}), llama.cpp {lc:e} ({lc_same})");
        }
    }
}

/// The AMX level's tile products of quantized weights compute the other levels' bits (src/engine/kernels/amx.rs)
/// whichever family calls them: each GGUF family's Q8_0 and Q4_1 file (the signed and the 4-bit layouts), with
/// prompts of 40-odd tokens so that products take whole tiles of 16 rows (the mixtures' experts some of theirs too),
/// writes at `runtime.cpu_kernels = "amx"` the results, log-probabilities included, that it writes at "vnni"; and so
/// at "auto", which there takes the int8 tiles for products of 32 rows or more (its load log says
/// `vnni+amx-int8`). Skipped, saying so, where the CPU or Linux gives no AMX.
#[test]
fn every_gguf_familys_quantized_files_write_the_same_results_at_the_amx_level_and_auto() {
    use crate::support::*;
    use nightshift::engine::kernels::Level;
    if !Level::available().contains(&Level::Amx) {
        eprintln!("this CPU (or Linux) gives no AMX tiles: the families' AMX check is skipped here");
        return;
    }
    let dir = scratch("gguf-families-amx");
    let input = dir.join("in.parquet");
    let long = "the heat of the theatre hit them as a thousand hands clapped at the end of the act and the actors bowed twice then three times";
    let ids: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
    write_parquet(&input, prompts(&ids, &[long, &format!("{long} {long}"), "the hat"]));
    for (family, head_dim, tied) in FAMILIES {
        for quant in [GgmlDType::Q8_0, GgmlDType::Q4_1] {
            let model = dir.join(format!("{family:?}-{quant:?}.gguf"));
            synth::write_gguf(&model, &spec(family, head_dim, tied, rope_theta(family)), quant).unwrap();
            let results: Vec<_> = ["vnni", "amx", "auto"]
                .into_iter()
                .map(|level| {
                    let out = dir.join(format!("{family:?}-{quant:?}-{level}"));
                    let runtime = format!("[runtime]\ndevice = \"cpu\"\ncpu_kernels = \"{level}\"");
                    let job = job_file_for(&dir.join("job.toml"), &model, input.to_str().unwrap(), out.to_str().unwrap(), "max_new_tokens = 6\nlogprobs = 2", &runtime);
                    let run = nightshift(&["run", job.to_str().unwrap()], &[("RUST_LOG", "info")]);
                    run.assert_ok();
                    let named = if level == "auto" { "vnni+amx-int8" } else { level };
                    assert!(run.stderr.contains(&format!("cpu_kernels=\"{named}\"")), "{}", run.stderr);
                    let mut rows = read_results_json(&out);
                    for row in rows.values_mut() {
                        let row = row.as_object_mut().expect("a result row is an object");
                        for timing in ["queue_s", "ttft_s", "e2e_s", "tpot_s"] {
                            row.remove(timing);
                        }
                    }
                    rows
                })
                .collect();
            assert_eq!(results[0].len(), 3, "{family:?} {quant:?}");
            assert_eq!(results[0], results[1], "{family:?} {quant:?}: the AMX level's results differ from VNNI's");
            assert_eq!(results[0], results[2], "{family:?} {quant:?}: auto's results (int8 tiles from 32 rows) differ from VNNI's");
        }
    }
}

/// How far nightshift's logits may be from llama.cpp's on a k-quant file, over the largest logit. Measured on a
/// Sapphire Rapids Xeon: 0.010-0.015 for each type, where each of the two is 0.008-0.015 from the float64 reference
/// on the same weights (`compare_a_file_with_llama_cpp_and_the_reference`): both quantize the activations to 8 bits.
const K_QUANT_TOLERANCE: f32 = 0.025;

/// The k-quants on nightshift's own kernels (Q3_K, Q4_K, Q5_K, Q6_K: their scales multiplied in as integers, the
/// activations quantized per 256 as llama.cpp's `Q8_K`) against llama.cpp on the same files: a llama model 256
/// wide (a whole k-quant block), every matrix of one type per file. The logits within [`K_QUANT_TOLERANCE`], and the
/// same argmax unless llama.cpp's own top two are closer than that (a tie either side's rounding may break: Q6_K's
/// third sequence, whose top two llama.cpp puts 0.1 % of the largest logit apart).
#[test]
fn k_quant_files_compute_what_llama_cpp_computes() {
    let Some(peer) = llama_peer() else { return };
    let dir = crate::support::scratch("k-quants-llama-cpp");
    let mut wide = spec(Family::Llama, 64, false, rope_theta(Family::Llama));
    (wide.shape.hidden, wide.shape.intermediate) = (256, 512);
    let seqs = sequences();
    for quant in [GgmlDType::Q3K, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let path = dir.join(format!("{quant:?}.gguf"));
        synth::write_gguf(&path, &wide, quant).unwrap();
        let (theirs, ours) = (peer_logits(&peer, &path, &seqs), nightshift_logits(&path, &seqs));
        for (i, (x, y)) in theirs.iter().zip(&ours).enumerate() {
            let (diff, same) = compare(std::slice::from_ref(x), std::slice::from_ref(y));
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            // How far below llama.cpp's top logit it puts nightshift's top token.
            let gap = (x[argmax(x)] - x[argmax(y)]) / scale;
            eprintln!("{quant:?} sequence {i}: largest difference {diff} of the largest logit, argmax agrees: {same} (llama.cpp's gap {gap})");
            assert!(diff <= K_QUANT_TOLERANCE && (same || gap <= K_QUANT_TOLERANCE), "{quant:?} sequence {i}: largest difference {diff}, argmax agrees: {same}, llama.cpp's gap {gap}");
        }
    }
}
