//! The kernels in plain Rust: any CPU, and the definition the SIMD levels match bit for bit (the same integer
//! block products, the same fused multiply-adds in the same eight lanes, the same reduction).

use std::ops::Range;

use super::{hsum8, Acts, Data, Out, Packed};

/// Activations to codes, per block of 32: scale `max |x| / 127`, codes rounded to nearest (ties to even), and the
/// scaled sums of the codes per 32 and per 16.
pub(super) fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32]) {
    for (b, (x, qs)) in x.chunks_exact(32).zip(qs.chunks_exact_mut(32)).enumerate() {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let mut sums = [0i32; 2];
        for (j, (q, v)) in qs.iter_mut().zip(x).enumerate() {
            // `as` saturates (and maps NaN to 0): a code is in -127..=127 whatever the input.
            *q = (v * inverse).round_ties_even().clamp(-127.0, 127.0) as i8;
            sums[j / 16] += *q as i32;
        }
        super::store_scales(scale, sums, &mut d[b], &mut s32[b], &mut s16[2 * b..2 * b + 2]);
    }
}

/// Lane `l` of a block product: the sum of weights `4l..4l + 4` times the activations' codes.
fn lanes(w: impl Fn(usize) -> i32, x: &[i8]) -> [i32; 8] {
    std::array::from_fn(|l| (4 * l..4 * l + 4).map(|j| w(j) * x[j] as i32).sum())
}

/// The offsets' part of a product, `sum(m[i] * s[i])`: lane `l` accumulates `i = l, l + 8, ...` (a short last
/// round padded with zeros), then the common reduction.
pub(super) fn min_dot(m: &[f32], s: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for c in 0..m.len().div_ceil(8) {
        for (l, acc) in acc.iter_mut().enumerate() {
            let i = 8 * c + l;
            let (a, b) = if i < m.len() { (m[i], s[i]) } else { (0.0, 0.0) };
            *acc = a.mul_add(b, *acc);
        }
    }
    hsum8(acc)
}

pub(super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let (k, blocks) = (w.k, w.k / 32);
    for n in rows {
        for r in 0..x.rows() {
            let xq = &x.qs[r * k..(r + 1) * k];
            let (p32, p16) = ((k / 32).next_multiple_of(8), (k / 16).next_multiple_of(8));
            let (xd, s32, s16) = (&x.d[r * blocks..], &x.s32[r * p32..(r + 1) * p32], &x.s16[r * p16..(r + 1) * p16]);
            let mut acc = [0f32; 8];
            let mut min = 0f32;
            match &w.data {
                Data::Q4 { qs, d, m } => {
                    let (qs, d) = (&qs[n * k / 2..(n + 1) * k / 2], &d[n * blocks..]);
                    min = min_dot(&m[n * p32..(n + 1) * p32], s32);
                    for b in 0..blocks {
                        let bytes = &qs[16 * b..16 * b + 16];
                        let p = lanes(|j| if j < 16 { bytes[j] & 0xF } else { bytes[j - 16] >> 4 } as i32, &xq[32 * b..]);
                        let scale = d[b] * xd[b];
                        for l in 0..8 {
                            acc[l] = (p[l] as f32).mul_add(scale, acc[l]);
                        }
                    }
                }
                Data::U8 { qs, d, m } => {
                    let (qs, d) = (&qs[n * k..(n + 1) * k], &d[2 * n * blocks..]);
                    min = min_dot(&m[n * p16..(n + 1) * p16], s16);
                    for b in 0..blocks {
                        let p = lanes(|j| qs[32 * b + j] as i32, &xq[32 * b..]);
                        let scales = [d[2 * b] * xd[b], d[2 * b + 1] * xd[b]];
                        for l in 0..8 {
                            acc[l] = (p[l] as f32).mul_add(scales[l / 4], acc[l]);
                        }
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
