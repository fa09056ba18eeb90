//! The paged backend's decode kernel (`runtime.attention = "paged-decode"`, what `auto` runs on a GPU without
//! flash-attention): every decode of a step (one new query per sequence) attends its whole sequence in one
//! launch per layer, reading the keys and values in place from the pool through the sequence's block table. The
//! tiled path gathers each key tile into a fresh copy, scores it with a matmul and runs the softmax as a dozen
//! element-wise kernels (the first GPU check measured that at 72 % of a batch-256 step and about 25 launches a
//! layer); the CUDA kernel does all of it in one pass, in f32 registers and shared memory (`paged_decode.cu` says
//! how). Prefills stay on the tiles.
//!
//! On the CPU the same operation runs a plain Rust reference of the kernel ([`PagedDecode::cpu_fwd`]): the tests
//! run the backend's decode plan (its tables, lengths and the step's row order) through it against the host
//! backend, which the CUDA kernel is then checked against on a GPU (`scripts/gpu-check.sh`).

use candle_core::{CpuStorage, Layout, Shape, Tensor};
#[cfg(feature = "cuda")]
use candle_core::{
    backend::BackendStorage,
    cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg},
    cuda_backend::{CudaStorageSlice, WrapErr},
    CudaStorage, DType, Storage,
};

/// The kernels' PTX, compiled by build.rs for the build's compute capability.
#[cfg(feature = "cuda")]
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_decode.ptx"));
/// Threads per block (`THREADS` in paged_decode.cu).
#[cfg(feature = "cuda")]
const THREADS: u32 = 128;

/// The widest head the kernel takes (`MAX_HEAD_DIM` in paged_decode.cu).
pub const MAX_HEAD_DIM: usize = 512;

/// Whether the kernel takes heads of this shape: an even width (rows are read two elements at a time) up to
/// [`MAX_HEAD_DIM`], query heads a whole number of groups per kv head.
pub fn takes_heads(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    head_dim.is_multiple_of(2) && head_dim <= MAX_HEAD_DIM && kv_heads > 0 && heads.is_multiple_of(kv_heads)
}

/// What every launch of a layer shares.
#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions per pool block.
    pub block: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    /// A sliding-window layer's window (the query sees its own position and `window - 1` before it).
    pub window: Option<usize>,
}

/// The decodes' attention output `[sequences, heads x head_dim]` in `q`'s dtype. `q`: their rotated queries,
/// `[sequences, heads x head_dim]`; `keys`, `values`: the layer's pool, `[slots, kv_heads, head_dim]`; `tables`:
/// `[sequences, width]` u32 block ids; `lens`: `[sequences]` u32, the positions each query sees (its cache and
/// itself).
pub fn paged_decode(q: &Tensor, keys: &Tensor, values: &Tensor, tables: &Tensor, lens: &Tensor, shape: DecodeShape) -> candle_core::Result<Tensor> {
    let op = PagedDecode { tables: tables.clone(), lens: lens.clone(), shape };
    q.contiguous()?.apply_op3_no_bwd(keys, values, &op)
}

/// The shapes the kernel takes: queries `[n, heads x head_dim]`, pools of whole blocks of `[kv_heads, head_dim]`
/// starting at an even element (the CUDA kernel reads rows two elements at a time), heads it takes
/// ([`takes_heads`]).
fn check(s: &DecodeShape, n: usize, q_l: &Layout, k_l: &Layout, v_l: &Layout) -> candle_core::Result<()> {
    let q_dims = q_l.shape().dims();
    if q_dims != [n, s.heads * s.head_dim] {
        candle_core::bail!("paged decode: queries {q_dims:?} for {n} sequences of {} heads of {}", s.heads, s.head_dim);
    }
    if !takes_heads(s.heads, s.kv_heads, s.head_dim) {
        candle_core::bail!("paged decode: heads {} / kv heads {} of {} are not supported", s.heads, s.kv_heads, s.head_dim);
    }
    for (l, what) in [(k_l, "keys"), (v_l, "values")] {
        let d = l.shape().dims();
        if d.len() != 3 || d[1] != s.kv_heads || d[2] != s.head_dim || s.block == 0 || !d[0].is_multiple_of(s.block) {
            candle_core::bail!("paged decode: {what} pool {d:?} for {} kv heads of {}", s.kv_heads, s.head_dim);
        }
        if !l.start_offset().is_multiple_of(2) {
            candle_core::bail!("paged decode: the {what} pool starts at an odd element");
        }
    }
    Ok(())
}

struct PagedDecode {
    tables: Tensor,
    lens: Tensor,
    shape: DecodeShape,
}

/// A contiguous tensor's CUDA slice from its first element.
#[cfg(feature = "cuda")]
fn slice<'a, T: candle_core::cuda_backend::CudaDType>(s: &'a CudaStorage, l: &Layout, what: &str) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.as_cuda_slice::<T>()?.slice(start..end)),
        None => candle_core::bail!("paged decode: {what} is not contiguous"),
    }
}

#[cfg(feature = "cuda")]
impl PagedDecode {
    #[allow(clippy::too_many_arguments)]
    fn launch<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
        &self,
        name: &str,
        q: &CudaStorage,
        q_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
        v: &CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let s = self.shape;
        let dev = q.device().clone();
        let (n, width) = self.tables.dims2()?;
        check(&s, n, q_l, k_l, v_l)?;
        let q = slice::<T>(q, q_l, "q")?;
        let k = slice::<T>(k, k_l, "keys")?;
        let v = slice::<T>(v, v_l, "values")?;
        let (tables, tables_l) = self.tables.storage_and_layout();
        let (lens, lens_l) = self.lens.storage_and_layout();
        let (Storage::Cuda(tables), Storage::Cuda(lens)) = (&*tables, &*lens) else {
            candle_core::bail!("paged decode: the block tables are not on the device")
        };
        let tables = slice::<u32>(tables, tables_l, "block tables")?;
        let lens = slice::<u32>(lens, lens_l, "lengths")?;
        if lens.len() != n {
            candle_core::bail!("paged decode: {} lengths for {n} sequences", lens.len());
        }
        let elements = n * s.heads * s.head_dim;
        // SAFETY: every element is written by the launch below: block (head, sequence) writes that head's
        // `head_dim` outputs (paged_decode.cu, the last lines of `paged_decode`), and the grid covers every head of
        // every sequence.
        let out: CudaSlice<T> = unsafe { dev.alloc::<T>(elements)? };
        if n > 0 {
            let func = dev.get_or_load_custom_func(name, "nightshift_paged_decode", PTX)?;
            let mut b = func.builder();
            b.arg(&q);
            b.arg(&k);
            b.arg(&v);
            b.arg(&tables);
            b.arg(&lens);
            b.arg(&out);
            let ints = [s.heads, s.kv_heads, s.head_dim, width, s.block].map(|x| x as i32);
            for i in &ints[..] {
                b.arg(i);
            }
            let (scale, softcap, window) = (s.scale, s.softcap.unwrap_or(0.0), s.window.unwrap_or(0) as i32);
            b.arg(&scale);
            b.arg(&softcap);
            b.arg(&window);
            // Key rows read 16 bytes at a time: every row a whole number of 16 bytes from a 16-byte aligned start
            // (the pool's allocation is; its offset must keep it so).
            let size = std::mem::size_of::<T>();
            let vec16 = i32::from((s.head_dim * size).is_multiple_of(16) && (k_l.start_offset() * size).is_multiple_of(16));
            b.arg(&vec16);
            let cfg = LaunchConfig { grid_dim: (s.heads as u32, n as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match the kernel's signature in paged_decode.cu (three T pointers, two u32
            // pointers, the T output, five ints, two floats, two ints); the shapes were checked above: q holds
            // `n x heads x head_dim` elements, the pools whole blocks of `kv_heads x head_dim`, the tables `n x
            // width` ids. The block ids and lengths come from the backend's own block tables, whose ids are pool
            // blocks and whose lengths are covered by their blocks (PagedAttention::book).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, s.heads * s.head_dim))))
    }
}

impl candle_core::CustomOp3 for PagedDecode {
    fn name(&self) -> &'static str {
        "nightshift-paged-decode"
    }

    /// The reference: the same attention in plain Rust, f32 (two passes over each sequence's visible keys).
    fn cpu_fwd(&self, q: &CpuStorage, q_l: &Layout, k: &CpuStorage, k_l: &Layout, v: &CpuStorage, v_l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let s = self.shape;
        let (n, width) = self.tables.dims2()?;
        let (hd, kvh, heads) = (s.head_dim, s.kv_heads, s.heads);
        check(&s, n, q_l, k_l, v_l)?;
        let tables = self.tables.flatten_all()?.to_vec1::<u32>()?;
        let lens = self.lens.to_vec1::<u32>()?;
        if lens.len() != n {
            candle_core::bail!("paged decode: {} lengths for {n} sequences", lens.len());
        }
        let floats = |st: &CpuStorage, l: &Layout, what: &str| -> candle_core::Result<Vec<f32>> {
            let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("paged decode: {what} is not contiguous") };
            Ok(match st {
                CpuStorage::F32(x) => x[a..b].to_vec(),
                CpuStorage::BF16(x) => x[a..b].iter().map(|x| x.to_f32()).collect(),
                CpuStorage::F16(x) => x[a..b].iter().map(|x| x.to_f32()).collect(),
                _ => candle_core::bail!("paged decode: queries and pool must be f32, bf16 or f16"),
            })
        };
        let (qf, kf, vf) = (floats(q, q_l, "q")?, floats(k, k_l, "keys")?, floats(v, v_l, "values")?);
        let slots = kf.len() / (kvh * hd);
        let mut out = vec![0f32; n * heads * hd];
        for seq in 0..n {
            let len = lens[seq] as usize;
            let first = s.window.map_or(0, |w| len.saturating_sub(w));
            let slot = |pos: usize| -> candle_core::Result<usize> {
                let id = *tables.get(seq * width + pos / s.block).filter(|_| pos / s.block < width).ok_or_else(|| candle_core::Error::Msg(format!("paged decode: position {pos} is past the block table")))?;
                let slot = id as usize * s.block + pos % s.block;
                if slot >= slots {
                    candle_core::bail!("paged decode: block {id} is past the pool");
                }
                Ok(slot)
            };
            for h in 0..heads {
                let kv = h / (heads / kvh);
                let qrow = &qf[(seq * heads + h) * hd..][..hd];
                let mut scores = Vec::with_capacity(len - first);
                for pos in first..len {
                    let krow = &kf[(slot(pos)? * kvh + kv) * hd..][..hd];
                    let mut x = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f32>() * s.scale;
                    if let Some(cap) = s.softcap {
                        x = (x / cap).tanh() * cap;
                    }
                    scores.push(x);
                }
                let top = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0f32;
                let orow = &mut out[(seq * heads + h) * hd..][..hd];
                for (pos, x) in (first..len).zip(&scores) {
                    let p = (x - top).exp();
                    total += p;
                    let vrow = &vf[(slot(pos)? * kvh + kv) * hd..][..hd];
                    for (o, v) in orow.iter_mut().zip(vrow) {
                        *o += p * v;
                    }
                }
                for o in orow.iter_mut() {
                    *o /= total;
                }
            }
        }
        let out = match q {
            CpuStorage::F32(_) => CpuStorage::F32(out),
            CpuStorage::BF16(_) => CpuStorage::BF16(out.iter().map(|&x| half::bf16::from_f32(x)).collect()),
            _ => CpuStorage::F16(out.iter().map(|&x| half::f16::from_f32(x)).collect()),
        };
        Ok((out, Shape::from((n, heads * hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, q: &CudaStorage, q_l: &Layout, k: &CudaStorage, k_l: &Layout, v: &CudaStorage, v_l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        if self.tables.dtype() != DType::U32 || self.lens.dtype() != DType::U32 {
            candle_core::bail!("paged decode: block tables and lengths must be u32");
        }
        match (&q.slice, &k.slice, &v.slice) {
            (CudaStorageSlice::F32(_), CudaStorageSlice::F32(_), CudaStorageSlice::F32(_)) => self.launch::<f32>("paged_decode_f32", q, q_l, k, k_l, v, v_l),
            (CudaStorageSlice::BF16(_), CudaStorageSlice::BF16(_), CudaStorageSlice::BF16(_)) => self.launch::<half::bf16>("paged_decode_bf16", q, q_l, k, k_l, v, v_l),
            (CudaStorageSlice::F16(_), CudaStorageSlice::F16(_), CudaStorageSlice::F16(_)) => self.launch::<half::f16>("paged_decode_f16", q, q_l, k, k_l, v, v_l),
            _ => candle_core::bail!("paged decode: queries and pool must share one of f32, bf16, f16"),
        }
    }
}
