//! Mixture-of-experts feed-forward networks (Mixtral, Qwen3-MoE, Qwen2-MoE): a router scores every expert for each
//! token, the `used` best (by softmax probability) compute the token's feed-forward network, and their outputs are
//! summed, each weighted by its probability (renormalized over the chosen experts where the family does, as Mixtral
//! and Qwen3-MoE do). Qwen2-MoE adds a shared expert that every token computes, its output weighted by the sigmoid
//! of its own one-row gate.
//!
//! The step's tokens are grouped by expert: each expert's SwiGLU runs once over the rows routed to it (on the CPU,
//! one call of the quantized kernels per expert with its rows), never a dense pass over every expert. The router
//! is computed in f32 from weights held in f32 (llama.cpp's converter stores it in F32 and `llama-quantize` never
//! quantizes it), by candle's f32 kernels on the CPU.
//!
//! Each layer's [`Routing`] counts the tokens each of its experts computed and the time spent routing, gathering
//! and combining, for the job's metrics (`expert_tokens`, `routing_s`: the model sums its layers').

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Tensor};

use crate::engine::kernels::Matrix;
use crate::engine::models::lanes::{product, Activation, Lane};
use crate::engine::ModelError;

/// What a mixture-of-experts model's feed-forward layers are.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub experts: usize,
    /// Experts each token is routed to (top-k).
    pub used: usize,
    /// Whether the chosen experts' probabilities are renormalized to sum to 1 (Mixtral, Qwen3-MoE).
    pub normalize: bool,
    /// The shared expert's feed-forward width, where every token also computes one (Qwen2-MoE).
    pub shared: Option<usize>,
}

impl MoeConfig {
    /// A configuration checked for what could not compute: no experts, more used than there are, absurd counts.
    pub fn new(experts: usize, used: usize, normalize: bool) -> Result<MoeConfig, ModelError> {
        if experts == 0 || used == 0 || used > experts || experts > 1 << 12 {
            return Err(ModelError::Metadata(format!("{used} experts used of {experts}: a mixture of experts routes each token to between 1 and all of its experts (at most 4,096)")));
        }
        Ok(MoeConfig { experts, used, normalize, shared: None })
    }

    /// With a shared expert `width` wide (checked as the experts' widths are).
    pub fn with_shared(mut self, width: usize) -> Result<MoeConfig, ModelError> {
        if width == 0 || width > 1 << 20 {
            return Err(ModelError::Metadata(format!("a shared expert {width} wide: its feed-forward width is between 1 and 1,048,576")));
        }
        self.shared = Some(width);
        Ok(self)
    }

    /// One line for `validate` and the load log.
    pub fn describe(&self) -> String {
        let norm = if self.normalize { ", their weights renormalized" } else { "" };
        let shared = self.shared.map(|w| format!(", and a shared expert {w} wide on every token, gated by a sigmoid")).unwrap_or_default();
        format!("mixture of experts: {} of {} experts per token{norm}{shared}", self.used, self.experts)
    }
}

/// The router: one row of weights per expert (`[experts, width]`, and a shared expert's gate as one row more), on the
/// model's device in f32 whatever the model's dtype: the logits are computed in f32, as llama.cpp computes them (a
/// bf16 product rounds them to three digits, and with 128 experts of which 8 are chosen the eighth and ninth are
/// often closer than that: the GPU check saw expert choices flip against the f32 reference).
pub struct Router {
    weights: Tensor,
}

impl Router {
    /// From a `[experts, width]` tensor of any float dtype, held in f32 on its device.
    pub fn new(weights: Tensor) -> candle_core::Result<Router> {
        weights.dims2()?;
        Ok(Router { weights: weights.to_dtype(DType::F32)? })
    }

    pub fn bytes(&self) -> usize {
        self.weights.elem_count() * self.weights.dtype().size_in_bytes()
    }

    /// Rows of logits the router gives each token.
    fn rows(&self) -> usize {
        self.weights.dim(0).unwrap_or(0)
    }

    /// The router's logits for `x` (`[rows, width]` row-major f32) of an f32 model on the CPU: `[rows, experts]`,
    /// by candle's f32 matrix product as [`product`] runs it for dense matrices (with at least its rows, so a row's
    /// logits do not depend on the rows beside it).
    pub fn logits_host(&self, x: &[f32]) -> candle_core::Result<Vec<f32>> {
        if !self.weights.device().is_cpu() || self.weights.dtype() != DType::F32 {
            candle_core::bail!("host router logits of a router held in {:?} off the CPU (a bug)", self.weights.dtype());
        }
        let width = self.weights.dim(1)?;
        let x = Tensor::from_slice(x, (x.len() / width, width), &Device::Cpu)?;
        product(&Matrix::Candle(QMatMul::Tensor(self.weights.clone())), &x)?.flatten_all()?.to_vec1::<f32>()
    }

    /// The logits of `x` `[rows, width]` (any float dtype) on its device, in f32, read back.
    pub fn logits_tensor(&self, x: &Tensor) -> candle_core::Result<Vec<f32>> {
        x.to_dtype(DType::F32)?.matmul(&self.weights.t()?)?.flatten_all()?.to_vec1::<f32>()
    }
}

/// One expert's SwiGLU matrices.
pub(crate) struct Expert {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

/// A layer's experts, their router, and what they computed.
pub(crate) struct Experts {
    pub router: Router,
    pub experts: Vec<Expert>,
    pub used: usize,
    pub normalize: bool,
    /// Qwen2-MoE's shared expert, computed for every token beside its routed experts, its output weighted by the
    /// sigmoid of its gate's logit: the router's last row, so one product (and on a GPU one read-back) gives a
    /// step's routing and gates together.
    pub shared: Option<Expert>,
    pub routing: Routing,
}

impl Experts {
    pub fn new(router: Router, experts: Vec<Expert>, config: &MoeConfig) -> Experts {
        let routing = Routing::new(experts.len());
        Experts { router, experts, used: config.used, normalize: config.normalize, shared: None, routing }
    }

    /// With a shared expert, its gate `[1, width]` (any float dtype) appended to the router's rows.
    pub fn with_shared(mut self, expert: Expert, gate: Tensor) -> candle_core::Result<Experts> {
        let router = &self.router.weights;
        let gate = gate.to_device(router.device())?.to_dtype(router.dtype())?;
        self.router = Router { weights: Tensor::cat(&[router, &gate], 0)? };
        self.shared = Some(expert);
        Ok(self)
    }

    pub fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        self.experts.iter().chain(&self.shared).flat_map(|e| [&e.gate, &e.up, &e.down])
    }
}

/// What the router chose for each of a step's tokens, from its logits `stride` to a token (the first `experts` of
/// them the experts'): `used` (expert, weight) pairs per token, by descending
/// probability (ties to the lower expert), as llama.cpp's `build_moe_ffn` with softmax gating: the softmax of
/// the logits in f32 (its sum in f64), the top `used`, and with `normalize` each divided by their sum (at least
/// 2^-14, as llama.cpp clamps it).
pub(crate) fn route(logits: &[f32], stride: usize, experts: usize, used: usize, normalize: bool) -> Vec<(u32, f32)> {
    let mut out = Vec::with_capacity(logits.len() / stride * used);
    let mut probs = vec![0f32; experts];
    let mut order: Vec<u32> = Vec::with_capacity(experts);
    for row in logits.chunks_exact(stride).map(|r| &r[..experts]) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f64;
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += f64::from(*p);
        }
        let scale = (1.0 / sum) as f32;
        probs.iter_mut().for_each(|p| *p *= scale);
        order.clear();
        order.extend(0..experts as u32);
        // NaN probabilities (a broken model) sort last.
        let key = |e: u32| if probs[e as usize].is_nan() { f32::NEG_INFINITY } else { probs[e as usize] };
        let by_probability = |a: &u32, b: &u32| key(*b).total_cmp(&key(*a)).then(a.cmp(b));
        if used < experts {
            order.select_nth_unstable_by(used - 1, by_probability);
        }
        order[..used].sort_by(by_probability);
        let chosen = &order[..used];
        let total = match normalize {
            true => chosen.iter().map(|&e| probs[e as usize]).sum::<f32>().max(6.103_515_6e-5),
            false => 1.0,
        };
        out.extend(chosen.iter().map(|&e| (e, if normalize { probs[e as usize] / total } else { probs[e as usize] })));
    }
    out
}

/// Tokens computed by each of a layer's experts and the time spent routing, gathering and combining, since they
/// were last taken ([`Routing::take`]).
pub struct Routing {
    tokens: Vec<AtomicU64>,
    nanos: AtomicU64,
}

impl Routing {
    pub fn new(experts: usize) -> Routing {
        Routing { tokens: (0..experts).map(|_| AtomicU64::new(0)).collect(), nanos: AtomicU64::new(0) }
    }

    /// The counts and seconds so far, reset to zero.
    pub fn take(&self) -> (Vec<u64>, f64) {
        let tokens = self.tokens.iter().map(|t| t.swap(0, Ordering::Relaxed)).collect();
        (tokens, self.nanos.swap(0, Ordering::Relaxed) as f64 * 1e-9)
    }
}

/// The layer's mixture of experts over `h` (the normed residual stream): the weighted sum of each token's chosen
/// experts' outputs.
pub(crate) fn run<L: Lane>(lane: &L, moe: &Experts, h: &L::X) -> candle_core::Result<L::X> {
    let routing = &moe.routing;
    let started = std::time::Instant::now();
    let experts = moe.experts.len();
    let logits = lane.router_logits(h, &moe.router)?;
    let stride = moe.router.rows();
    let choices = route(&logits, stride, experts, moe.used, moe.normalize);
    let mut groups: Vec<(Vec<u32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); experts];
    for (token, chosen) in choices.chunks_exact(moe.used).enumerate() {
        for &(e, w) in chosen {
            groups[e as usize].0.push(token as u32);
            groups[e as usize].1.push(w);
        }
    }
    let mut out = lane.zeros(h)?;
    let mut in_ffn = std::time::Duration::ZERO;
    for ((rows, weights), (expert, counter)) in groups.iter().zip(moe.experts.iter().zip(&routing.tokens)) {
        if rows.is_empty() {
            continue;
        }
        counter.fetch_add(rows.len() as u64, Ordering::Relaxed);
        let x = lane.gather(h, rows)?;
        let ffn = std::time::Instant::now();
        let y = lane.gated_ffn(&x, &expert.gate, &expert.up, &expert.down, Activation::Silu)?;
        in_ffn += ffn.elapsed();
        out = lane.scatter_add(out, &y, rows, weights)?;
    }
    // The shared expert over every row, weighted by sigmoid(gate . h) (llama.cpp's `silu(x) / x`, the same function),
    // the gate's logit the last of each token's.
    if let Some(e) = &moe.shared {
        let weights: Vec<f32> = logits.chunks_exact(stride).map(|r| 1.0 / (1.0 + (-r[experts]).exp())).collect();
        let rows: Vec<u32> = (0..weights.len() as u32).collect();
        let ffn = std::time::Instant::now();
        let y = lane.gated_ffn(h, &e.gate, &e.up, &e.down, Activation::Silu)?;
        in_ffn += ffn.elapsed();
        out = lane.scatter_add(out, &y, &rows, &weights)?;
    }
    routing.nanos.fetch_add(started.elapsed().saturating_sub(in_ffn).as_nanos() as u64, Ordering::Relaxed);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax, top-k and renormalization as llama.cpp (and Hugging Face's Mixtral and Qwen3-MoE) compute them.
    #[test]
    fn routing_picks_the_most_probable_experts_and_weighs_them() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0, 0.0, 0.5, 0.25];
        let chosen = route(&logits, 4, 4, 2, true);
        // Token 0: experts 1 and 3 tie at the top (the lower first), each weighing a half once renormalized.
        assert_eq!(chosen[..2].iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        assert!((chosen[0].1 - 0.5).abs() < 1e-6 && (chosen[1].1 - 0.5).abs() < 1e-6);
        // Token 1: experts 2 and 3; unnormalized, their softmax probabilities.
        let raw = route(&logits, 4, 4, 2, false);
        let exps: Vec<f64> = logits[4..].iter().map(|&l| f64::from(l).exp()).collect();
        let total: f64 = exps.iter().sum();
        assert_eq!((raw[2].0, raw[3].0), (2, 3));
        assert!((f64::from(raw[2].1) - exps[2] / total).abs() < 1e-6);
        assert!((f64::from(raw[3].1) - exps[3] / total).abs() < 1e-6);
        let norm = &chosen[2..];
        assert!((f64::from(norm[0].1) - exps[2] / (exps[2] + exps[3])).abs() < 1e-6);
        assert!((norm[0].1 + norm[1].1 - 1.0).abs() < 1e-6);
        // A NaN logit neither panics nor wins.
        let nan = route(&[f32::NAN, 1.0, 0.0, 2.0], 4, 4, 1, true);
        assert_eq!(nan.len(), 1);
    }

    #[test]
    fn router_logits_are_dot_products() {
        let w = Tensor::from_vec((0..3 * 20).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<_>>(), (3, 20), &candle_core::Device::Cpu).unwrap();
        let router = Router::new(w.clone()).unwrap();
        let x: Vec<f32> = (0..2 * 20).map(|i| (i as f32 * 0.11).cos()).collect();
        let ours = router.logits_host(&x).unwrap();
        let xt = Tensor::from_vec(x, (2, 20), &candle_core::Device::Cpu).unwrap();
        let theirs = router.logits_tensor(&xt).unwrap();
        for (a, b) in ours.iter().zip(&theirs) {
            assert!((a - b).abs() < 1e-5, "{a} {b}");
        }
        assert!(MoeConfig::new(8, 9, true).is_err() && MoeConfig::new(0, 0, true).is_err());
        assert_eq!(MoeConfig::new(8, 2, true).unwrap().describe(), "mixture of experts: 2 of 8 experts per token, their weights renormalized");
    }
}
