//! The kernels in plain Rust: any CPU, and the definition the SIMD levels match bit for bit (the same integer
//! block products, the same fused multiply-adds in the same eight lanes, the same reduction).

use std::ops::Range;

use super::{hsum8, Acts, Data, Out, Packed};

/// Lane `l` of a block product: the sum of weights `4l..4l + 4` times the activations' codes.
fn lanes(w: impl Fn(usize) -> i32, x: &[i8]) -> [i32; 8] {
    std::array::from_fn(|l| (4 * l..4 * l + 4).map(|j| w(j) * x[j] as i32).sum())
}

pub(super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let (k, blocks) = (w.k, w.k / 32);
    for n in rows {
        for r in 0..x.rows() {
            let xq = &x.qs[r * k..(r + 1) * k];
            let (xd, s32, s16) = (&x.d[r * blocks..], &x.s32[r * blocks..], &x.s16[2 * r * blocks..]);
            let mut acc = [0f32; 8];
            let mut min = 0f32;
            match &w.data {
                Data::Q4 { qs, d, m } => {
                    let (qs, d, m) = (&qs[n * k / 2..(n + 1) * k / 2], &d[n * blocks..], &m[n * blocks..]);
                    for b in 0..blocks {
                        let bytes = &qs[16 * b..16 * b + 16];
                        let p = lanes(|j| if j < 16 { bytes[j] & 0xF } else { bytes[j - 16] >> 4 } as i32, &xq[32 * b..]);
                        let scale = d[b] * xd[b];
                        for l in 0..8 {
                            acc[l] = (p[l] as f32).mul_add(scale, acc[l]);
                        }
                        min = m[b].mul_add(s32[b], min);
                    }
                }
                Data::U8 { qs, d, m } => {
                    let (qs, d, m) = (&qs[n * k..(n + 1) * k], &d[2 * n * blocks..], &m[2 * n * blocks..]);
                    for b in 0..blocks {
                        let p = lanes(|j| qs[32 * b + j] as i32, &xq[32 * b..]);
                        let scales = [d[2 * b] * xd[b], d[2 * b + 1] * xd[b]];
                        for l in 0..8 {
                            acc[l] = (p[l] as f32).mul_add(scales[l / 4], acc[l]);
                        }
                        min = m[2 * b].mul_add(s16[2 * b], min);
                        min = m[2 * b + 1].mul_add(s16[2 * b + 1], min);
                    }
                }
                Data::S8 { qs, d } => {
                    let (qs, d) = (&qs[n * k..(n + 1) * k], &d[n * blocks..]);
                    for b in 0..blocks {
                        let p = lanes(|j| qs[32 * b + j] as i32, &xq[32 * b..]);
                        let scale = d[b] * xd[b];
                        for l in 0..8 {
                            acc[l] = (p[l] as f32).mul_add(scale, acc[l]);
                        }
                    }
                }
                Data::F16(_) | Data::Bf16(_) => unreachable!("float weights take the float loop"),
            }
            out.write(r, n, hsum8(acc) + min);
        }
    }
}

/// Float weights (F16, BF16): lane `l` accumulates columns `l, l + 8, ...` with fused multiply-adds.
pub(super) fn run_float(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let k = w.k;
    let (bits, widen): (&[u16], fn(u16) -> f32) = match &w.data {
        Data::F16(bits) => (bits, |h| half::f16::from_bits(h).to_f32()),
        Data::Bf16(bits) => (bits, |h| half::bf16::from_bits(h).to_f32()),
        _ => unreachable!("quantized weights take the block loop"),
    };
    for n in rows {
        let row = &bits[n * k..(n + 1) * k];
        for r in 0..x.rows() {
            let xs = &x.f32[r * k..(r + 1) * k];
            let mut acc = [0f32; 8];
            for (ws, xs) in row.chunks_exact(8).zip(xs.chunks_exact(8)) {
                for l in 0..8 {
                    acc[l] = widen(ws[l]).mul_add(xs[l], acc[l]);
                }
            }
            out.write(r, n, hsum8(acc));
        }
    }
}
