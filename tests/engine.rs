//! The decoder on the real SmolLM2 weights: one packed forward pass equals the same work done piecewise.

use candle_core::Device;
use nightshift::engine::{KvCache, Model, Segment};

use crate::support::model_path;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Two arbitrary prompts of valid token ids.
const A: &[u32] = &[504, 5305, 314, 7208, 1834, 30];
const B: &[u32] = &[10591, 42, 216, 33, 216, 34, 216, 35, 216, 36];

#[test]
fn prefill_equals_token_by_token_decode_and_packing_changes_nothing() {
    let (model, _) = Model::load(&model_path(), &Device::Cpu).unwrap();
    let cfg = model.config.clone();

    // Whole prompt in one pass.
    let mut whole = KvCache::new(&cfg, 32);
    let prefill = model.forward(&mut [Segment { tokens: A, cache: &mut whole }]).unwrap().remove(0);

    // The same prompt one token at a time through the KV cache.
    let mut stepwise = KvCache::new(&cfg, 32);
    let mut last = Vec::new();
    for token in A {
        last = model.forward(&mut [Segment { tokens: std::slice::from_ref(token), cache: &mut stepwise }]).unwrap().remove(0);
    }
    assert_eq!(whole.len(), A.len());
    assert_eq!(stepwise.len(), A.len());
    let diff = max_abs_diff(&prefill, &last);
    assert!(diff <= 1e-4, "prefill and token-by-token logits differ by {diff}");

    // Two prompts packed into one pass, next to a decode step of a third sequence, give what each gives alone.
    let mut alone_b = KvCache::new(&cfg, 32);
    let b_alone = model.forward(&mut [Segment { tokens: B, cache: &mut alone_b }]).unwrap().remove(0);
    let next = [nightshift::engine::sampling::argmax(&prefill)];
    let decode_alone = model.forward(&mut [Segment { tokens: &next, cache: &mut whole }]).unwrap().remove(0);

    let (mut packed_a, mut packed_b) = (KvCache::new(&cfg, 32), KvCache::new(&cfg, 32));
    model.forward(&mut [Segment { tokens: A, cache: &mut packed_a }]).unwrap();
    let mut packed_c = KvCache::new(&cfg, 32);
    let packed = model
        .forward(&mut [
            Segment { tokens: &next, cache: &mut packed_a },
            Segment { tokens: B, cache: &mut packed_b },
            Segment { tokens: A, cache: &mut packed_c },
        ])
        .unwrap();
    assert_eq!(packed.len(), 3);
    assert_eq!(max_abs_diff(&packed[0], &decode_alone), 0.0, "a decode step depends on its batch");
    assert_eq!(max_abs_diff(&packed[1], &b_alone), 0.0, "a packed prefill depends on its batch");
    assert_eq!(max_abs_diff(&packed[2], &prefill), 0.0, "a packed prefill depends on its batch");
    assert_eq!(packed_b.len(), B.len());
}

#[test]
fn tokens_outside_the_vocabulary_and_overlong_segments_are_errors() {
    let (model, _) = Model::load(&model_path(), &Device::Cpu).unwrap();
    let mut cache = KvCache::new(&model.config, 4);
    let bad = [model.config.vocab_size as u32];
    assert!(model.forward(&mut [Segment { tokens: &bad, cache: &mut cache }]).is_err());
    assert!(cache.is_empty(), "a failed pass must not extend the cache");
    let too_long = vec![1u32; model.config.context_length + 1];
    assert!(model.forward(&mut [Segment { tokens: &too_long, cache: &mut cache }]).is_err());
}
