//! The llama family's layers, and the one loop that runs them over a [`Lane`] (host vectors on the CPU's fast
//! path, candle tensors elsewhere): pre-norm attention (q, k and v projections, with biases and per-head norms
//! where the checkpoint has them) and a SwiGLU feed-forward network (or a mixture of SwiGLU experts: Mixtral,
//! Qwen3-MoE), each added to the residual stream.

use candle_core::Tensor;

use crate::engine::attention::{Attention, Segment};
use crate::engine::kernels::Matrix;
use crate::engine::models::lanes::{Activation, Lane, Vector};
use crate::engine::models::moe;

pub(crate) struct Layer {
    pub attn_norm: Vector,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    /// Biases of the q, k and v projections (Qwen2; llama checkpoints with `attention_bias`), `[rows]` each.
    pub qkv_bias: Option<[Vector; 3]>,
    /// Bias of the output projection (llama and Qwen3 checkpoints with `attention_bias`).
    pub wo_bias: Option<Vector>,
    /// Per-head RMSNorm weights of queries and keys, `[head_dim]` each, applied before RoPE (Qwen3).
    pub qk_norm: Option<[Vector; 2]>,
    pub ffn_norm: Vector,
    pub ffn: Ffn,
}

/// A layer's feed-forward network: one gated network, or a mixture of experts ([`moe`]).
pub(crate) enum Ffn {
    Dense { gate: Matrix, up: Matrix, down: Matrix },
    Experts(Box<moe::Experts>),
}

impl Ffn {
    /// The network over `h` (the normed residual stream), `act` the dense network's activation (experts' is SiLU).
    pub fn run<L: Lane>(&self, lane: &L, h: &L::X, act: Activation) -> candle_core::Result<L::X> {
        match self {
            Ffn::Dense { gate, up, down } => lane.gated_ffn(h, gate, up, down, act),
            Ffn::Experts(experts) => moe::run(lane, experts, h),
        }
    }
}

/// Optional vectors from the loaders' tensors.
pub(super) fn vectors<const N: usize>(tensors: Option<[Tensor; N]>) -> Option<[Vector; N]> {
    tensors.map(|t| t.map(Vector::from))
}

impl Layer {
    /// The layer's matrices (every expert's too).
    pub fn matrices(&self) -> Vec<&Matrix> {
        let mut out = vec![&self.wq, &self.wk, &self.wv, &self.wo];
        match &self.ffn {
            Ffn::Dense { gate, up, down } => out.extend([gate, up, down]),
            Ffn::Experts(experts) => out.extend(experts.matrices()),
        }
        out
    }

    /// The layer's vectors (norms, biases).
    fn vectors_mut(&mut self) -> impl Iterator<Item = &mut Vector> {
        [&mut self.attn_norm, &mut self.ffn_norm]
            .into_iter()
            .chain(self.qkv_bias.iter_mut().flatten())
            .chain(self.wo_bias.iter_mut())
            .chain(self.qk_norm.iter_mut().flatten())
    }

    /// Its vectors' bytes (and a router's).
    pub fn vector_bytes(&self) -> usize {
        let router = match &self.ffn {
            Ffn::Experts(experts) => experts.router.bytes(),
            Ffn::Dense { .. } => 0,
        };
        router + [&self.attn_norm, &self.ffn_norm].into_iter().chain(self.qkv_bias.iter().flatten()).chain(&self.wo_bias).chain(self.qk_norm.iter().flatten()).map(Vector::bytes).sum::<usize>()
    }

    /// Its vectors read into host memory, for the host lane.
    pub fn keep_host(&mut self) -> candle_core::Result<()> {
        self.vectors_mut().try_for_each(Vector::keep_host)
    }
}

/// The layers over `x`, the embedded tokens (in `lane`'s form): the last hidden states. `eps`: RMSNorm's epsilon
/// over the laid-out width; `head_eps` the per-head norms'.
pub(crate) fn run<L: Lane, A: Attention>(
    lane: &L,
    layers: &[Layer],
    attention: &A,
    step: &A::Step,
    segments: &mut [Segment<'_, A::Cache>],
    mut x: L::X,
    (eps, head_eps): (f32, f32),
) -> candle_core::Result<L::X> {
    for (li, layer) in layers.iter().enumerate() {
        let out = attention_block(lane, layer, li, attention, step, segments, &x, (eps, head_eps))?;
        x = lane.add(x, &out)?;
        let h = lane.rms_norm(&x, &layer.ffn_norm, eps)?;
        x = lane.add(x, &lane.reduce(layer.ffn.run(lane, &h, Activation::Silu)?)?)?;
    }
    Ok(x)
}

/// Layer `li`'s attention over the residual stream `x`, before the residual add (which a family may norm first):
/// RMSNorm, the q, k and v products, their biases and per-head q/k norms where the layer has them, attention, the
/// output projection (summed over a tensor-parallel model's ranks) and its bias.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_block<L: Lane, A: Attention>(
    lane: &L,
    layer: &Layer,
    li: usize,
    attention: &A,
    step: &A::Step,
    segments: &mut [Segment<'_, A::Cache>],
    x: &L::X,
    (eps, head_eps): (f32, f32),
) -> candle_core::Result<L::X> {
    let h = lane.rms_norm(x, &layer.attn_norm, eps)?;
    let [mut q, mut k, mut v] = lane.products(&h, [&layer.wq, &layer.wk, &layer.wv])?;
    if let Some([bq, bk, bv]) = &layer.qkv_bias {
        (q, k, v) = (lane.add_bias(q, bq)?, lane.add_bias(k, bk)?, lane.add_bias(v, bv)?);
    }
    if let Some([q_norm, k_norm]) = &layer.qk_norm {
        (q, k) = (lane.head_norm(q, q_norm, head_eps)?, lane.head_norm(k, k_norm, head_eps)?);
    }
    let attn = lane.attend(attention, step, li, [q, k, v], segments)?;
    let [out] = lane.products(&attn, [&layer.wo])?;
    // A tensor-parallel rank's heads give part of the sum; the bias is added once, to the whole.
    let mut out = lane.reduce(out)?;
    if let Some(b) = &layer.wo_bias {
        out = lane.add_bias(out, b)?;
    }
    Ok(out)
}
