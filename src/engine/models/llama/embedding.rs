//! The token embedding table.
//!
//! On the CPU the table stays as the file stores it, and the rows a step's tokens name are widened or dequantized
//! to f32 as they are looked up: a large vocabulary's table is most of a small model's memory in f32 (Llama 3's
//! 128,256 x 2,048 is 1 GiB, 210 MiB as a Q4_K_M file's Q6_K, 512 MiB in bf16), and a step reads a few rows of
//! it. The values are the widened table's: a 16-bit value widens exactly, and a GGUF row is dequantized block by
//! block by the same function that dequantizes the whole table (candle's `QTensor::embedding`). Elsewhere (an
//! accelerator) the table is dense, in the activations' dtype.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Tensor};

use crate::engine::kernels::{Matrix, Packed};

/// A model's token embedding table.
#[derive(Clone)]
pub enum Embedding {
    /// Dense, in the activations' dtype.
    Dense(Tensor),
    /// A Hugging Face checkpoint's bf16 or f16 table, as stored, on the CPU: rows widened to f32.
    Sixteen(Tensor),
    /// A GGUF's table as stored (any type the file holds), on the CPU: rows dequantized to f32, then zero-padded to
    /// `width` (the hidden state's width in memory, [`super::Layout`]).
    Stored { table: Arc<QTensor>, width: usize },
    /// A tied table on the CPU held once, as the output projection's matrix in the kernels' layout (the file's
    /// values, as stored): rows dequantized to f32 from it ([`Packed::dequantize_row`], the same values as
    /// `Stored`'s or `Sixteen`'s), then zero-padded to `width`.
    Packed { matrix: Arc<Packed>, width: usize },
}

impl Embedding {
    /// The rows of `ids` (`u32`, `[n]`): `[n, width]` in the activations' dtype.
    pub(super) fn lookup(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Embedding::Dense(t) => t.index_select(ids, 0),
            Embedding::Sixteen(t) => t.index_select(ids, 0)?.to_dtype(DType::F32),
            Embedding::Stored { table, width } => {
                let rows = table.embedding(ids)?;
                let d = table.shape().dims2()?.1;
                match width.checked_sub(d) {
                    Some(0) => Ok(rows),
                    Some(pad) => rows.pad_with_zeros(1, 0, pad),
                    None => candle_core::bail!("an embedding table {d} wide for a hidden state of {width} (a bug)"),
                }
            }
            Embedding::Packed { matrix, width } => {
                let (rows, d) = (matrix.rows(), matrix.columns());
                if d > *width {
                    candle_core::bail!("an embedding table {d} wide for a hidden state of {width} (a bug)");
                }
                let (device, ids) = (ids.device().clone(), ids.to_vec1::<u32>()?);
                let mut out = vec![0f32; ids.len() * width];
                for (&id, out) in ids.iter().zip(out.chunks_exact_mut(*width)) {
                    if id as usize >= rows {
                        candle_core::bail!("token id {id} is past the embedding table's {rows} rows");
                    }
                    matrix.dequantize_row(id as usize, &mut out[..d]);
                }
                Tensor::from_vec(out, (ids.len(), *width), &device)
            }
        }
    }

    /// The hidden state's width in memory.
    pub(super) fn width(&self) -> Option<usize> {
        match self {
            Embedding::Dense(t) | Embedding::Sixteen(t) => t.dims().last().copied(),
            Embedding::Stored { width, .. } | Embedding::Packed { width, .. } => Some(*width),
        }
    }

    /// The activations' dtype that the rows come in.
    pub(super) fn dtype(&self) -> DType {
        match self {
            Embedding::Dense(t) => t.dtype(),
            Embedding::Sixteen(_) | Embedding::Stored { .. } | Embedding::Packed { .. } => DType::F32,
        }
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Embedding::Dense(t) | Embedding::Sixteen(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Embedding::Stored { table, .. } => table.storage_size_in_bytes(),
            Embedding::Packed { matrix, .. } => matrix.bytes(),
        }
    }

    /// The table as a tensor (dense, or 16-bit as stored), if it is one.
    pub(super) fn tensor(&self) -> Option<&Tensor> {
        match self {
            Embedding::Dense(t) | Embedding::Sixteen(t) => Some(t),
            Embedding::Stored { .. } | Embedding::Packed { .. } => None,
        }
    }

    /// Whether `t` is this table (a tied output projection held as the same tensor).
    pub(super) fn is(&self, t: &Tensor) -> bool {
        matches!(self, Embedding::Dense(e) if e.id() == t.id())
    }

    /// Whether `m` is this table's matrix (a tied output projection held once, [`Embedding::Packed`]).
    pub(super) fn holds(&self, m: &Matrix) -> bool {
        matches!((self, m), (Embedding::Packed { matrix, .. }, Matrix::Packed(p)) if Arc::ptr_eq(matrix, p))
    }

    /// Whether two tables are held alike (kind, shape and dtype): tensor-parallel ranks share one.
    pub(super) fn alike(&self, other: &Embedding) -> bool {
        match (self, other) {
            (Embedding::Dense(a), Embedding::Dense(b)) | (Embedding::Sixteen(a), Embedding::Sixteen(b)) => a.shape() == b.shape() && a.dtype() == b.dtype(),
            (Embedding::Stored { table: a, width: wa }, Embedding::Stored { table: b, width: wb }) => a.shape() == b.shape() && a.dtype() == b.dtype() && wa == wb,
            (Embedding::Packed { matrix: a, width: wa }, Embedding::Packed { matrix: b, width: wb }) => {
                (a.rows(), a.columns(), a.stored_dtype()) == (b.rows(), b.columns(), b.stored_dtype()) && wa == wb
            }
            _ => false,
        }
    }

    /// What the log says of it.
    pub(super) fn describe(&self) -> String {
        match self {
            Embedding::Dense(t) => format!("dense {:?}", t.dtype()),
            Embedding::Sixteen(t) => format!("{:?} as stored, rows widened to f32 when looked up", t.dtype()),
            Embedding::Stored { table, .. } => format!("{:?} as stored, rows dequantized to f32 when looked up", table.dtype()),
            Embedding::Packed { matrix, .. } => format!("{:?} as stored, held once with the tied output projection, rows dequantized to f32 when looked up", matrix.stored_dtype()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::Device;

    /// A table of every type a GGUF's embedding commonly takes, looked up as stored: the rows of the whole table
    /// dequantized (what the table was before), bit for bit, zero-padded to a wider hidden state; repeated and
    /// unordered ids; an id past the table an error. A 16-bit table's rows widened exactly. The bytes held are
    /// the stored ones.
    #[test]
    fn rows_looked_up_as_stored_are_the_dequantized_tables_rows() {
        let (rows, d) = (50, 512);
        let values: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.7331).sin() * (1.0 + (i % 13) as f32)).collect();
        let dense = Tensor::from_vec(values, (rows, d), &Device::Cpu).unwrap();
        let ids = Tensor::new(&[3u32, 49, 0, 3, 17], &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::F16, GgmlDType::F32] {
            for width in [d, d + 64] {
                let q = QTensor::quantize(&dense, dtype).unwrap();
                let table = q.dequantize(&Device::Cpu).unwrap().pad_with_zeros(1, 0, width - d).unwrap();
                let expected = table.index_select(&ids, 0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let stored = Embedding::Stored { table: Arc::new(q), width };
                let got = stored.lookup(&ids).unwrap();
                assert_eq!(got.dims(), &[5, width]);
                let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(got.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} width {width}");
                assert_eq!((stored.width(), stored.dtype()), (Some(width), DType::F32));
                if dtype != GgmlDType::F32 {
                    assert!(stored.bytes() * 2 <= rows * d * 4, "{dtype:?}: {} bytes held", stored.bytes());
                }
                assert!(stored.lookup(&Tensor::new(&[50u32], &Device::Cpu).unwrap()).is_err(), "an id past the table");
            }
        }
        for dtype in [DType::BF16, DType::F16] {
            let t = dense.to_dtype(dtype).unwrap();
            let expected = t.to_dtype(DType::F32).unwrap().index_select(&ids, 0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let sixteen = Embedding::Sixteen(t);
            let got = sixteen.lookup(&ids).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert!(got.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}");
            assert_eq!((sixteen.bytes(), sixteen.dtype()), (rows * d * 2, DType::F32));
        }
    }

    /// A tied table held once as the output projection's packed matrix: every type the kernels take, its rows looked
    /// up there the same bits as the table as stored gives them (the dequantized table's, the widened 16-bit
    /// one's), zero-padded to a wider hidden state; rows in the last, partly filled panel of eight; an id past the
    /// table an error; the bytes are the matrix's, and the table holds that matrix and no other.
    #[test]
    fn a_tied_table_held_once_looks_up_the_stored_rows() {
        let (rows, d) = (53, 512);
        let values: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.4217).cos() * (0.5 + (i % 11) as f32)).collect();
        let dense = Tensor::from_vec(values, (rows, d), &Device::Cpu).unwrap();
        let ids = Tensor::new(&[52u32, 3, 0, 48, 3, 17], &Device::Cpu).unwrap();
        let mut tables: Vec<(String, Embedding, Matrix)> = Vec::new();
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::Q8_0, GgmlDType::Q3K, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
            let q = QTensor::quantize(&dense, dtype).unwrap();
            let packed = Arc::new(Packed::from_qtensor(&q).unwrap().unwrap_or_else(|| panic!("{dtype:?} packs")));
            tables.push((format!("{dtype:?}"), Embedding::Stored { table: Arc::new(q), width: d }, Matrix::Packed(packed)));
        }
        for dtype in [DType::BF16, DType::F16] {
            let t = dense.to_dtype(dtype).unwrap();
            let m = Matrix::packed_16bit(&t).unwrap().expect("16-bit packs");
            tables.push((format!("{dtype:?}"), Embedding::Sixteen(t), m));
        }
        for (name, reference, matrix) in tables {
            let Matrix::Packed(p) = &matrix else { unreachable!() };
            for width in [d, d + 64] {
                let reference = match reference.clone() {
                    Embedding::Stored { table, .. } => Embedding::Stored { table, width },
                    other => other,
                };
                let mut expected = reference.lookup(&ids).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                if width > d && matches!(reference, Embedding::Sixteen(_)) {
                    expected = expected.chunks(d).flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(0.0, width - d))).collect();
                }
                let held = Embedding::Packed { matrix: p.clone(), width };
                let got = held.lookup(&ids).unwrap();
                assert_eq!(got.dims(), &[6, width], "{name}");
                let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let bad: Vec<(usize, f32, f32)> = got.iter().zip(&expected).enumerate().filter(|(_, (a, b))| a.to_bits() != b.to_bits()).map(|(i, (a, b))| (i, *a, *b)).take(5).collect();
                assert!(bad.is_empty(), "{name} width {width}: {bad:?}");
                assert_eq!((held.width(), held.dtype(), held.bytes()), (Some(width), DType::F32, matrix.bytes()), "{name}");
                assert!(held.lookup(&Tensor::new(&[53u32], &Device::Cpu).unwrap()).is_err(), "{name}: an id past the table");
                assert!(held.holds(&matrix) && !held.holds(&Matrix::Packed(Arc::new(Packed::from_qtensor(&QTensor::quantize(&dense, GgmlDType::Q8_0).unwrap()).unwrap().unwrap()))));
            }
        }
    }
}
