//! What every decoder family's layer loop computes with: weight vectors in the forms the loop needs, and the
//! [`Lane`]s a loop is written over, so one loop runs both the CPU's fast path and every device.
//!
//! - [`TensorLane`]: activations as candle tensors, on any device and in any dtype.
//! - [`HostLane`]: activations as host vectors, for an f32 model on the CPU whose matrices are all on nightshift's
//!   kernels, and an attention backend that attends on host vectors: no copy between candle tensors and the
//!   kernels' vectors at every product, norm and residual add.
//!
//! Both lanes compute the same bits on the CPU: the same kernels, the same RMSNorm ([`rms_norm_host`]'s, which
//! [`rms_norm`] runs on the CPU in f32), the same f32 adds (tested per family against each other). Without packed
//! matrices the tensor lane's gated feed-forward network is candle's (its own SiLU and GELU).

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Tensor};
use rayon::prelude::*;

use crate::engine::attention::{Attention, Segment};
pub use crate::engine::kernels::elementwise::Activation;
use crate::engine::kernels::Matrix;
use crate::engine::models::moe::Router;
use crate::engine::parallel::Rank;

/// A vector of weights (a norm's, a bias): the tensor, and its values in host memory where a host lane reads it
/// ([`Vector::keep_host`]).
pub struct Vector {
    pub tensor: Tensor,
    host: Option<Vec<f32>>,
}

impl From<Tensor> for Vector {
    fn from(tensor: Tensor) -> Vector {
        Vector { tensor, host: None }
    }
}

impl Vector {
    /// Reads the values into host memory, for a [`HostLane`] (f32 on the CPU).
    pub fn keep_host(&mut self) -> candle_core::Result<()> {
        self.host = Some(self.tensor.to_vec1::<f32>()?);
        Ok(())
    }

    fn host(&self) -> candle_core::Result<&[f32]> {
        self.host.as_deref().ok_or_else(|| candle_core::Error::Msg("a weight vector the host lane reads is not in host memory (a bug)".into()))
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        self.tensor.elem_count() * self.tensor.dtype().size_in_bytes()
    }
}

/// Where a step's activations (`[tokens, width]`) live between a layer loop's operations, and those operations.
pub trait Lane {
    type X;

    /// RMSNorm of every row (rows as wide as `weight`).
    fn rms_norm(&self, x: &Self::X, weight: &Vector, eps: f32) -> candle_core::Result<Self::X>;

    /// RMSNorm of every head of every row: rows of `weight`'s width (a head's).
    fn head_norm(&self, x: Self::X, weight: &Vector, eps: f32) -> candle_core::Result<Self::X>;

    /// `bias` added to every row.
    fn add_bias(&self, x: Self::X, bias: &Vector) -> candle_core::Result<Self::X>;

    /// `x · Wᵀ` for each matrix, `x` quantized once where the kernels take it.
    fn products<const N: usize>(&self, x: &Self::X, weights: [&Matrix; N]) -> candle_core::Result<[Self::X; N]>;

    /// The gated feed-forward network, `down · (act(gate · x) * (up · x))`: SwiGLU with [`Activation::Silu`],
    /// GeGLU with [`Activation::GeluTanh`].
    fn gated_ffn(&self, x: &Self::X, gate: &Matrix, up: &Matrix, down: &Matrix, act: Activation) -> candle_core::Result<Self::X>;

    /// Layer `layer`'s attention (queries, keys and values before RoPE).
    fn attend<A: Attention>(&self, attention: &A, step: &A::Step, layer: usize, qkv: [Self::X; 3], segments: &mut [Segment<'_, A::Cache>]) -> candle_core::Result<Self::X>;

    /// The residual stream, `x + y`.
    fn add(&self, x: Self::X, y: &Self::X) -> candle_core::Result<Self::X>;

    /// A mixture of experts' router logits for every row, `[rows, experts]` f32 in host memory.
    fn router_logits(&self, x: &Self::X, router: &Router) -> candle_core::Result<Vec<f32>>;

    /// The rows `rows` of `x`, in that order.
    fn gather(&self, x: &Self::X, rows: &[u32]) -> candle_core::Result<Self::X>;

    /// Zeros of `x`'s shape.
    fn zeros(&self, x: &Self::X) -> candle_core::Result<Self::X>;

    /// `acc[rows[j]] += weights[j] * y[j]` for each row `j` of `y` (`rows` distinct): an expert's outputs added
    /// into the layer's.
    fn scatter_add(&self, acc: Self::X, y: &Self::X, rows: &[u32], weights: &[f32]) -> candle_core::Result<Self::X>;

    /// A row-split product's partial sums (the attention output's and the feed-forward network's) summed over a
    /// tensor-parallel model's ranks ([`crate::engine::parallel`]); `x` itself on one rank.
    fn reduce(&self, x: Self::X) -> candle_core::Result<Self::X>;
}

/// `acc[rows[j]] += weights[j] * y[j]` on host rows `width` wide: the product rounded to f32, then the sum.
fn scatter_add_host(acc: &mut [f32], y: &[f32], rows: &[u32], weights: &[f32], width: usize) -> candle_core::Result<()> {
    if y.len() != rows.len() * width || weights.len() != rows.len() {
        candle_core::bail!("{} expert outputs for {} rows and {} weights (a bug)", y.len() / width.max(1), rows.len(), weights.len());
    }
    for ((src, &row), &w) in y.chunks_exact(width).zip(rows).zip(weights) {
        let dst = acc.get_mut(row as usize * width..(row as usize + 1) * width).ok_or_else(|| candle_core::Error::Msg(format!("row {row} outside the step (a bug)")))?;
        dst.iter_mut().zip(src).for_each(|(a, &v)| *a += w * v);
    }
    Ok(())
}

/// The rows `rows` of host rows `width` wide.
fn gather_host(x: &[f32], rows: &[u32], width: usize) -> candle_core::Result<Vec<f32>> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(x.get(r as usize * width..(r as usize + 1) * width).ok_or_else(|| candle_core::Error::Msg(format!("row {r} outside the step (a bug)")))?);
    }
    Ok(out)
}

/// Whether a tensor's activations are computed on the host as the host lane computes them: f32 on the CPU.
fn on_host(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// Activations as candle tensors: any device, any dtype; `tp`, the rank of a tensor-parallel model.
pub struct TensorLane<'a> {
    pub tp: Option<&'a Rank>,
}

impl Lane for TensorLane<'_> {
    type X = Tensor;

    fn rms_norm(&self, x: &Tensor, weight: &Vector, eps: f32) -> candle_core::Result<Tensor> {
        rms_norm(x, &weight.tensor, eps)
    }

    fn head_norm(&self, x: Tensor, weight: &Vector, eps: f32) -> candle_core::Result<Tensor> {
        let (n, width) = x.dims2()?;
        let head = weight.tensor.dim(0)?;
        rms_norm(&x.reshape((n * width / head, head))?, &weight.tensor, eps)?.reshape((n, width))
    }

    fn add_bias(&self, x: Tensor, bias: &Vector) -> candle_core::Result<Tensor> {
        x.broadcast_add(&bias.tensor)
    }

    fn products<const N: usize>(&self, x: &Tensor, weights: [&Matrix; N]) -> candle_core::Result<[Tensor; N]> {
        // One matrix: `product`'s (candle's dense kernels with at least DENSE_MIN_ROWS rows); several: together.
        if let [w] = weights.as_slice() {
            let one = product(w, x)?;
            return Ok(std::array::from_fn(|_| one.clone()));
        }
        matmuls(x, weights)
    }

    fn gated_ffn(&self, x: &Tensor, gate: &Matrix, up: &Matrix, down: &Matrix, act: Activation) -> candle_core::Result<Tensor> {
        if let Some(y) = Matrix::ffn_packed(x, gate, up, down, act)? {
            return Ok(y);
        }
        let [g, u] = matmuls(x, [gate, up])?;
        let g = match act {
            Activation::Silu => candle_nn::ops::silu(&g)?,
            // candle's `gelu` is the tanh approximation (`gelu_erf` the exact one).
            Activation::GeluTanh => g.gelu()?,
        };
        product(down, &(g * u)?)
    }

    fn attend<A: Attention>(&self, attention: &A, step: &A::Step, layer: usize, qkv: [Tensor; 3], segments: &mut [Segment<'_, A::Cache>]) -> candle_core::Result<Tensor> {
        attention.attend(step, layer, qkv, segments)
    }

    fn add(&self, x: Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        x + y
    }

    // On the CPU in f32, the host lane's arithmetic (the same bits); elsewhere candle's.
    fn router_logits(&self, x: &Tensor, router: &Router) -> candle_core::Result<Vec<f32>> {
        match on_host(x) {
            true => router.logits_host(&x.flatten_all()?.to_vec1::<f32>()?),
            false => router.logits_tensor(x),
        }
    }

    fn gather(&self, x: &Tensor, rows: &[u32]) -> candle_core::Result<Tensor> {
        x.index_select(&Tensor::from_slice(rows, rows.len(), x.device())?, 0)
    }

    fn zeros(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.zeros_like()
    }

    fn scatter_add(&self, acc: Tensor, y: &Tensor, rows: &[u32], weights: &[f32]) -> candle_core::Result<Tensor> {
        let (n, width) = acc.dims2()?;
        if on_host(&acc) && on_host(y) {
            let mut values = acc.flatten_all()?.to_vec1::<f32>()?;
            scatter_add_host(&mut values, &y.flatten_all()?.to_vec1::<f32>()?, rows, weights, width)?;
            return Tensor::from_vec(values, (n, width), acc.device());
        }
        let w = Tensor::from_slice(weights, (weights.len(), 1), y.device())?.to_dtype(y.dtype())?;
        acc.index_add(&Tensor::from_slice(rows, rows.len(), y.device())?, &y.broadcast_mul(&w)?, 0)
    }
    fn reduce(&self, x: Tensor) -> candle_core::Result<Tensor> {
        match self.tp {
            Some(rank) => rank.all_reduce_tensor(x),
            None => Ok(x),
        }
    }
}

/// Activations as host vectors, `rows` rows, row-major: an f32 model on the CPU whose matrices are all the
/// kernels' and whose vectors are kept in host memory, and a backend that attends on host vectors; `tp`, the rank
/// of a tensor-parallel model.
pub struct HostLane<'a> {
    pub rows: usize,
    pub tp: Option<&'a Rank>,
}

fn not_packed(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what} of the host lane is not on the kernels (a bug)"))
}

impl Lane for HostLane<'_> {
    type X = Vec<f32>;

    fn rms_norm(&self, x: &Vec<f32>, weight: &Vector, eps: f32) -> candle_core::Result<Vec<f32>> {
        Ok(rms_norm_host(x, weight.host()?, eps))
    }

    fn head_norm(&self, x: Vec<f32>, weight: &Vector, eps: f32) -> candle_core::Result<Vec<f32>> {
        Ok(rms_norm_host(&x, weight.host()?, eps))
    }

    fn add_bias(&self, mut x: Vec<f32>, bias: &Vector) -> candle_core::Result<Vec<f32>> {
        // As candle's broadcast add: one f32 add per element.
        let bias = bias.host()?;
        x.chunks_exact_mut(bias.len()).for_each(|row| add_assign(row, bias));
        Ok(x)
    }

    fn products<const N: usize>(&self, x: &Vec<f32>, weights: [&Matrix; N]) -> candle_core::Result<[Vec<f32>; N]> {
        Matrix::products_host(x, self.rows, &weights)?.and_then(|outs| outs.try_into().ok()).ok_or_else(|| not_packed("a product"))
    }

    fn gated_ffn(&self, x: &Vec<f32>, gate: &Matrix, up: &Matrix, down: &Matrix, act: Activation) -> candle_core::Result<Vec<f32>> {
        // The step's rows, or an expert's share of them.
        let rows = x.len() / gate.columns().max(1);
        Matrix::ffn_host(x, rows, gate, up, down, act)?.ok_or_else(|| not_packed("the feed-forward network"))
    }

    fn attend<A: Attention>(&self, attention: &A, step: &A::Step, layer: usize, qkv: [Vec<f32>; 3], segments: &mut [Segment<'_, A::Cache>]) -> candle_core::Result<Vec<f32>> {
        attention.attend_host(step, layer, qkv, segments)
    }

    fn add(&self, mut x: Vec<f32>, y: &Vec<f32>) -> candle_core::Result<Vec<f32>> {
        add_assign(&mut x, y);
        Ok(x)
    }

    fn router_logits(&self, x: &Vec<f32>, router: &Router) -> candle_core::Result<Vec<f32>> {
        router.logits_host(x)
    }

    fn gather(&self, x: &Vec<f32>, rows: &[u32]) -> candle_core::Result<Vec<f32>> {
        gather_host(x, rows, x.len() / self.rows.max(1))
    }

    fn zeros(&self, x: &Vec<f32>) -> candle_core::Result<Vec<f32>> {
        Ok(vec![0f32; x.len()])
    }

    fn scatter_add(&self, mut acc: Vec<f32>, y: &Vec<f32>, rows: &[u32], weights: &[f32]) -> candle_core::Result<Vec<f32>> {
        let width = acc.len() / self.rows.max(1);
        scatter_add_host(&mut acc, y, rows, weights, width)?;
        Ok(acc)
    }
    fn reduce(&self, mut x: Vec<f32>) -> candle_core::Result<Vec<f32>> {
        if let Some(rank) = self.tp {
            rank.all_reduce(&mut x)?;
        }
        Ok(x)
    }
}

/// RMSNorm of `x`'s rows: on the CPU in f32, [`rms_norm_host`]'s arithmetic (so the tensor loop and the host loop
/// compute the same bits); elsewhere candle's.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 || weight.dtype() != DType::F32 {
        return candle_nn::ops::rms_norm(x, weight, eps);
    }
    let values = x.flatten_all()?.to_vec1::<f32>()?;
    let w = weight.to_vec1::<f32>()?;
    if w.is_empty() || values.len() % w.len() != 0 {
        candle_core::bail!("RMSNorm of {} values with a weight of {}", values.len(), w.len());
    }
    Tensor::from_vec(rms_norm_host(&values, &w, eps), x.shape(), x.device())
}

/// RMSNorm of each row of `x` (rows as wide as `weight`) as llama.cpp computes it (`ggml_compute_forward_rms_norm`
/// and the weight's multiply): each square rounded to f32 and summed in f64 (llama.cpp in order, here over eight
/// lanes: the f64 sums differ by a few of their ulps, 1e-16 relative, which the mean's rounding to f32 hides but
/// at a tie), the mean rounded to f32, then
/// `x * (1 / sqrt(mean + eps)) * weight`. Summing in f64 is the more exact of the two; candle's f32 sum and divide
/// agreed with llama.cpp's greedy choices at 96.9 % of the Q4_1 file's positions, this at 97.2 %
/// (`scripts/fidelity-llama.py`, BENCHMARKS.md). Rows in parallel past 32.
pub(crate) fn rms_norm_host(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let width = weight.len();
    let mut out = vec![0f32; x.len()];
    let row = |(src, dst): (&[f32], &mut [f32])| {
        // The squares summed in f64 over eight lanes (columns `l, l + 8, ...`), added pairwise at the end: one
        // sequential sum was a chain of dependent additions, 2 % of a prefill.
        let mut lanes = [0f64; 8];
        let columns = src.chunks_exact(8);
        let rest = columns.remainder();
        for c in columns {
            for l in 0..8 {
                lanes[l] += f64::from(c[l] * c[l]);
            }
        }
        let mut sum2 = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        for &v in rest {
            sum2 += f64::from(v * v);
        }
        let mean = (sum2 / width as f64) as f32;
        let scale = 1.0f32 / (mean + eps).sqrt();
        for ((d, &s), &w) in dst.iter_mut().zip(src).zip(weight) {
            *d = s * scale * w;
        }
    };
    if x.len() / width.max(1) <= 32 {
        x.chunks_exact(width).zip(out.chunks_exact_mut(width)).for_each(row);
    } else {
        x.par_chunks_exact(width).zip(out.par_chunks_exact_mut(width)).for_each(row);
    }
    out
}

/// `x += y`, element by element.
pub(crate) fn add_assign(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "residual add of different lengths (a bug)");
    x.iter_mut().zip(y).for_each(|(a, &b)| *a += b);
}

/// The fewest rows a dense (f32) matrix product is computed with. candle's f32 matmul (the gemm crate) takes
/// other kernels for a few rows (a matrix-vector product for one row; measured: up to four rows at narrow widths),
/// which round differently, so a sequence's values would depend on how many rows share its step; fewer rows are
/// padded with zero rows. A lone decode step computes eight rows instead of one, which costs little while reading
/// the weights, the same for both, dominates.
const DENSE_MIN_ROWS: usize = 8;

/// `x · Wᵀ`: the CPU's kernels for a packed matrix; candle's otherwise, with dense weights computing at least
/// [`DENSE_MIN_ROWS`] rows.
pub(crate) fn product(w: &Matrix, x: &Tensor) -> candle_core::Result<Tensor> {
    let w = match w {
        Matrix::Packed(_) => return Ok(Matrix::forward_packed(x, &[w])?.and_then(|mut o| o.pop()).expect("a packed matrix's product")),
        Matrix::Candle(w) => w,
    };
    let rows = x.dim(0)?;
    match w {
        QMatMul::Tensor(_) if rows < DENSE_MIN_ROWS && x.device().is_cpu() => w.forward(&x.pad_with_zeros(0, 0, DENSE_MIN_ROWS - rows)?)?.narrow(0, 0, rows),
        _ => w.forward(x),
    }
}

/// Products of one input with several weight matrices (q, k and v; gate and up), the input quantized once and the
/// products run in one parallel region: by the CPU's kernels for packed matrices, by candle for same-type
/// quantized ones (where it can); otherwise one by one.
pub(crate) fn matmuls<const N: usize>(x: &Tensor, weights: [&Matrix; N]) -> candle_core::Result<[Tensor; N]> {
    if let Some(outs) = Matrix::forward_packed(x, &weights)? {
        return Ok(outs.try_into().unwrap_or_else(|_| unreachable!("one output per weight")));
    }
    let tensors: Option<Vec<&QTensor>> = weights.iter().map(|w| if let Matrix::Candle(QMatMul::QTensor(t)) = w { Some(t.as_ref()) } else { None }).collect();
    if let Some(tensors) = tensors {
        if let Some(outs) = QTensor::gemv_fused_shared_lhs(&tensors, x)? {
            if let Ok(outs) = <[Tensor; N]>::try_from(outs) {
                return Ok(outs);
            }
        }
    }
    let outs: Vec<Tensor> = weights.iter().map(|w| product(w, x)).collect::<candle_core::Result<_>>()?;
    Ok(outs.try_into().unwrap_or_else(|_| unreachable!("one output per weight")))
}
