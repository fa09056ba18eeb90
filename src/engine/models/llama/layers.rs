//! The llama family's layers, and the one loop that runs them: pre-norm attention (q, k and v projections, their
//! biases and per-head norms where the checkpoint has them) and a SwiGLU feed-forward network, each added to the
//! residual stream.
//!
//! The loop is written once over a [`Lane`], where a step's activations live between the operations:
//! - [`TensorLane`]: candle tensors, on any device and in any dtype;
//! - [`HostLane`]: host vectors, for an f32 model on the CPU whose matrices are all on nightshift's kernels and an
//!   attention backend that attends on host vectors: no copy between candle tensors and the kernels' vectors at
//!   every product, norm and residual add.
//!
//! Both lanes compute the same bits on the CPU: the same kernels, the same RMSNorm ([`super::rms_norm_host`]'s, which
//! [`super::rms_norm`] runs on the CPU in f32), the same f32 adds.

use candle_core::Tensor;

use super::{add_assign, matmuls, product, rms_norm, rms_norm_host};
use crate::engine::attention::{Attention, Segment};
use crate::engine::kernels::Matrix;

pub(super) struct Layer {
    pub attn_norm: Tensor,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    /// Biases of the q, k and v projections (Qwen2; llama checkpoints with `attention_bias`), `[rows]` each.
    pub qkv_bias: Option<[Tensor; 3]>,
    /// Bias of the output projection (llama and Qwen3 checkpoints with `attention_bias`).
    pub wo_bias: Option<Tensor>,
    /// Per-head RMSNorm weights of queries and keys, `[head_dim]` each, applied before RoPE (Qwen3).
    pub qk_norm: Option<[Tensor; 2]>,
    pub ffn_norm: Tensor,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

impl Layer {
    /// The matrices of the layer.
    pub fn matrices(&self) -> [&Matrix; 7] {
        [&self.wq, &self.wk, &self.wv, &self.wo, &self.w_gate, &self.w_up, &self.w_down]
    }

    /// Its vectors (norm weights and biases) as host vectors, for the [`HostLane`].
    pub fn host(&self) -> candle_core::Result<HostLayer> {
        let v = |t: &Tensor| t.to_vec1::<f32>();
        Ok(HostLayer {
            attn_norm: v(&self.attn_norm)?,
            ffn_norm: v(&self.ffn_norm)?,
            qkv_bias: match &self.qkv_bias {
                Some([q, k, b]) => Some([v(q)?, v(k)?, v(b)?]),
                None => None,
            },
            wo_bias: self.wo_bias.as_ref().map(v).transpose()?,
            qk_norm: match &self.qk_norm {
                Some([q, k]) => Some([v(q)?, v(k)?]),
                None => None,
            },
        })
    }
}

/// A layer's vectors in host memory (its matrices are the kernels' already).
pub(super) struct HostLayer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    qkv_bias: Option<[Vec<f32>; 3]>,
    wo_bias: Option<Vec<f32>>,
    qk_norm: Option<[Vec<f32>; 2]>,
}

/// Which of a layer's norms.
#[derive(Clone, Copy)]
pub(super) enum Norm {
    Attention,
    Ffn,
}

/// Where a step's activations (`[tokens, width]`) live through the layers, and the loop's operations there.
pub(super) trait Lane {
    type X;

    /// RMSNorm of every row with one of layer `li`'s norms.
    fn norm(&self, x: &Self::X, li: usize, layer: &Layer, which: Norm, eps: f32) -> candle_core::Result<Self::X>;

    /// The q, k and v projections of `h`, with their biases and per-head norms (`head_eps`) where the layer has them.
    fn qkv(&self, h: &Self::X, li: usize, layer: &Layer, head_dim: usize, head_eps: f32) -> candle_core::Result<[Self::X; 3]>;

    /// The output projection of the attention, with its bias where the layer has one.
    fn output(&self, attn: &Self::X, li: usize, layer: &Layer) -> candle_core::Result<Self::X>;

    /// The feed-forward network, `down · (silu(gate · h) * (up · h))`.
    fn ffn(&self, h: &Self::X, layer: &Layer) -> candle_core::Result<Self::X>;

    fn attend<A: Attention>(&self, attention: &A, step: &A::Step, li: usize, qkv: [Self::X; 3], segments: &mut [Segment<'_, A::Cache>]) -> candle_core::Result<Self::X>;

    /// The residual stream `x + y`.
    fn add(&self, x: Self::X, y: &Self::X) -> candle_core::Result<Self::X>;
}

/// The layers over `x`, the embedded tokens (in `lane`'s form): the last hidden states. `eps`: RMSNorm's epsilon
/// over the laid-out width; `head_eps` the per-head norms'.
#[allow(clippy::too_many_arguments)] // the loop's inputs, one call per step
pub(super) fn run<L: Lane, A: Attention>(
    lane: &L,
    layers: &[Layer],
    attention: &A,
    step: &A::Step,
    segments: &mut [Segment<'_, A::Cache>],
    mut x: L::X,
    head_dim: usize,
    (eps, head_eps): (f32, f32),
) -> candle_core::Result<L::X> {
    for (li, layer) in layers.iter().enumerate() {
        let h = lane.norm(&x, li, layer, Norm::Attention, eps)?;
        let qkv = lane.qkv(&h, li, layer, head_dim, head_eps)?;
        let attn = lane.attend(attention, step, li, qkv, segments)?;
        x = lane.add(x, &lane.output(&attn, li, layer)?)?;
        let h = lane.norm(&x, li, layer, Norm::Ffn, eps)?;
        x = lane.add(x, &lane.ffn(&h, layer)?)?;
    }
    Ok(x)
}

/// Activations as candle tensors: any device, any dtype.
pub(super) struct TensorLane;

impl Lane for TensorLane {
    type X = Tensor;

    fn norm(&self, x: &Tensor, _li: usize, layer: &Layer, which: Norm, eps: f32) -> candle_core::Result<Tensor> {
        match which {
            Norm::Attention => rms_norm(x, &layer.attn_norm, eps),
            Norm::Ffn => rms_norm(x, &layer.ffn_norm, eps),
        }
    }

    fn qkv(&self, h: &Tensor, _li: usize, layer: &Layer, head_dim: usize, head_eps: f32) -> candle_core::Result<[Tensor; 3]> {
        let [q, k, v] = matmuls(h, [&layer.wq, &layer.wk, &layer.wv])?;
        let [q, k, v] = match &layer.qkv_bias {
            Some([bq, bk, bv]) => [q.broadcast_add(bq)?, k.broadcast_add(bk)?, v.broadcast_add(bv)?],
            None => [q, k, v],
        };
        let Some([q_norm, k_norm]) = &layer.qk_norm else { return Ok([q, k, v]) };
        let per_head = |x: Tensor, w: &Tensor| -> candle_core::Result<Tensor> {
            let (n, width) = x.dims2()?;
            rms_norm(&x.reshape((n * width / head_dim, head_dim))?, w, head_eps)?.reshape((n, width))
        };
        Ok([per_head(q, q_norm)?, per_head(k, k_norm)?, v])
    }

    fn output(&self, attn: &Tensor, _li: usize, layer: &Layer) -> candle_core::Result<Tensor> {
        let out = product(&layer.wo, attn)?;
        match &layer.wo_bias {
            Some(b) => out.broadcast_add(b),
            None => Ok(out),
        }
    }

    fn ffn(&self, h: &Tensor, layer: &Layer) -> candle_core::Result<Tensor> {
        if let Some(y) = Matrix::ffn_packed(h, &layer.w_gate, &layer.w_up, &layer.w_down)? {
            return Ok(y);
        }
        let [gate, up] = matmuls(h, [&layer.w_gate, &layer.w_up])?;
        product(&layer.w_down, &(candle_nn::ops::silu(&gate)? * up)?)
    }

    fn attend<A: Attention>(&self, attention: &A, step: &A::Step, li: usize, qkv: [Tensor; 3], segments: &mut [Segment<'_, A::Cache>]) -> candle_core::Result<Tensor> {
        attention.attend(step, li, qkv, segments)
    }

    fn add(&self, x: Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        x + y
    }
}

/// Activations as host vectors, `rows` rows, row-major: an f32 model on the CPU whose matrices are all the
/// kernels', its layers' vectors in `layers`, and a backend that attends on host vectors.
pub(super) struct HostLane<'a> {
    pub layers: &'a [HostLayer],
    pub rows: usize,
}

impl HostLane<'_> {
    fn products<const N: usize>(&self, x: &[f32], weights: [&Matrix; N], what: &str) -> candle_core::Result<[Vec<f32>; N]> {
        Matrix::products_host(x, self.rows, &weights)?
            .and_then(|outs| outs.try_into().ok())
            .ok_or_else(|| candle_core::Error::Msg(format!("{what} of the host layer loop is not on the kernels (a bug)")))
    }
}

/// `bias` added to every row of `x` (rows as wide as `bias`), as candle's broadcast add does: one f32 add each.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    x.chunks_exact_mut(bias.len()).for_each(|row| add_assign(row, bias));
}

impl Lane for HostLane<'_> {
    type X = Vec<f32>;

    fn norm(&self, x: &Vec<f32>, li: usize, _layer: &Layer, which: Norm, eps: f32) -> candle_core::Result<Vec<f32>> {
        let host = &self.layers[li];
        Ok(rms_norm_host(x, match which {
            Norm::Attention => &host.attn_norm,
            Norm::Ffn => &host.ffn_norm,
        }, eps))
    }

    fn qkv(&self, h: &Vec<f32>, li: usize, layer: &Layer, _head_dim: usize, head_eps: f32) -> candle_core::Result<[Vec<f32>; 3]> {
        let host = &self.layers[li];
        let [mut q, mut k, mut v] = self.products(h, [&layer.wq, &layer.wk, &layer.wv], "the q, k and v products")?;
        if let Some([bq, bk, bv]) = &host.qkv_bias {
            add_rows(&mut q, bq);
            add_rows(&mut k, bk);
            add_rows(&mut v, bv);
        }
        // Per head: rows as wide as the norm's weights (`head_dim`).
        if let Some([q_norm, k_norm]) = &host.qk_norm {
            q = rms_norm_host(&q, q_norm, head_eps);
            k = rms_norm_host(&k, k_norm, head_eps);
        }
        Ok([q, k, v])
    }

    fn output(&self, attn: &Vec<f32>, li: usize, layer: &Layer) -> candle_core::Result<Vec<f32>> {
        let [mut out] = self.products(attn, [&layer.wo], "the output projection")?;
        if let Some(b) = &self.layers[li].wo_bias {
            add_rows(&mut out, b);
        }
        Ok(out)
    }

    fn ffn(&self, h: &Vec<f32>, layer: &Layer) -> candle_core::Result<Vec<f32>> {
        Matrix::ffn_host(h, self.rows, &layer.w_gate, &layer.w_up, &layer.w_down)?
            .ok_or_else(|| candle_core::Error::Msg("the feed-forward network of the host layer loop is not on the kernels (a bug)".into()))
    }

    fn attend<A: Attention>(&self, attention: &A, step: &A::Step, li: usize, qkv: [Vec<f32>; 3], segments: &mut [Segment<'_, A::Cache>]) -> candle_core::Result<Vec<f32>> {
        attention.attend_host(step, li, qkv, segments)
    }

    fn add(&self, mut x: Vec<f32>, y: &Vec<f32>) -> candle_core::Result<Vec<f32>> {
        add_assign(&mut x, y);
        Ok(x)
    }
}
