//! The kernels in plain Rust: any CPU, and the definition the SIMD levels match bit for bit (the same exact
//! integer block sums, the same fused multiply-adds in the same order for each output; for float weights, the
//! same eight lanes and reduction).

use std::ops::Range;

use super::{hsum8, Acts, Data, Out, Packed, PANEL};

/// Activations to codes, per block of 32: scale `max |x| / 127`, codes rounded to nearest (ties to even), and the
/// scaled sums of the codes per 32 and per 16.
pub(super) fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32], sums_out: &mut [i32], sums16: &mut [i32]) {
    for (b, (x, qs)) in x.chunks_exact(32).zip(qs.chunks_exact_mut(32)).enumerate() {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        // llama.cpp's reciprocal, `127 / max` (not `1 / scale`, which can round differently).
        let inverse = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sums = [0i32; 2];
        for (j, (q, v)) in qs.iter_mut().zip(x).enumerate() {
            // `as` saturates (and maps NaN to 0): a code is in -127..=127 whatever the input.
            *q = (v * inverse).round_ties_even().clamp(-127.0, 127.0) as i8;
            sums[j / 16] += *q as i32;
        }
        super::store_scales(scale, sums, &mut d[b], &mut s32[b], &mut s16[2 * b..2 * b + 2], &mut sums_out[b], &mut sums16[2 * b..2 * b + 2]);
    }
}

/// Weight rows `rows` (whole panels, the last possibly padded) times every activation row: for each output, per
/// block of 32 (per group of 16 for `U8`) the exact integer sum of code products (for `Q6`, the two halves' sums
/// times their scales), then `acc = fma(sum, d_w * d_x, acc)` and, for types with an offset,
/// `acc = fma(m_w, s_x, acc)`, in block order.
pub(super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let (k, blocks) = (w.k, w.k / 32);
    for p in rows.start / PANEL..rows.end.div_ceil(PANEL) {
        for r in 0..x.rows() {
            let xq = &x.qs[r * k..(r + 1) * k];
            let (xd, s32, s16) = (&x.d[r * blocks..(r + 1) * blocks], &x.s32[r * blocks..(r + 1) * blocks], &x.s16[r * 2 * blocks..(r + 1) * 2 * blocks]);
            let mut acc = [0f32; PANEL];
            for b in 0..blocks {
                let (pb, xb) = (p * blocks + b, &xq[32 * b..32 * b + 32]);
                match &w.data {
                    Data::Q4 { qs, d, m } => {
                        let bytes = &qs[pb * 128..(pb + 1) * 128];
                        for (l, acc) in acc.iter_mut().enumerate() {
                            let mut sum = 0i32;
                            for t in 0..4 {
                                for j in 0..4 {
                                    let byte = bytes[32 * t + 4 * l + j];
                                    sum += (byte & 0xF) as i32 * xb[4 * t + j] as i32 + (byte >> 4) as i32 * xb[16 + 4 * t + j] as i32;
                                }
                            }
                            if m.is_empty() {
                                // Q4_0: the codes stand for `code - 8`.
                                *acc = ((sum - 8 * x.sums[r * blocks + b]) as f32).mul_add(d[pb * PANEL + l] * xd[b], *acc);
                            } else {
                                *acc = (sum as f32).mul_add(d[pb * PANEL + l] * xd[b], *acc);
                                *acc = m[pb * PANEL + l].mul_add(s32[b], *acc);
                            }
                        }
                    }
                    Data::U8 { qs, d, m } => {
                        let codes = &qs[pb * 256..(pb + 1) * 256];
                        for h in 0..2 {
                            for (l, acc) in acc.iter_mut().enumerate() {
                                let sum: i32 = (4 * h..4 * h + 4).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| codes[32 * g + 4 * l + j] as i32 * xb[4 * g + j] as i32).sum();
                                let at = (2 * pb + h) * PANEL + l;
                                *acc = (sum as f32).mul_add(d[at] * xd[b], *acc);
                                *acc = m[at].mul_add(s16[2 * b + h], *acc);
                            }
                        }
                    }
                    Data::S8 { qs, d } => {
                        let codes = &qs[pb * 256..(pb + 1) * 256];
                        for (l, acc) in acc.iter_mut().enumerate() {
                            let sum: i32 = (0..8).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| (codes[32 * g + 4 * l + j] ^ 0x80) as i8 as i32 * xb[4 * g + j] as i32).sum();
                            *acc = (sum as f32).mul_add(d[pb * PANEL + l] * xd[b], *acc);
                        }
                    }
                    Data::Q6 { qs, sc, d } => {
                        let codes = &qs[pb * 256..(pb + 1) * 256];
                        for (l, acc) in acc.iter_mut().enumerate() {
                            // Per half: sum((q - 32) x) = sum(q x) - 32 sum(x), times its scale, all exact in i32.
                            let sum: i32 = (0..2)
                                .map(|h| {
                                    let dot: i32 = (4 * h..4 * h + 4).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| codes[32 * g + 4 * l + j] as i32 * xb[4 * g + j] as i32).sum();
                                    sc[(2 * pb + h) * PANEL + l] as i32 * (dot - 32 * x.sums16[r * 2 * blocks + 2 * b + h])
                                })
                                .sum();
                            *acc = (sum as f32).mul_add(d[(p * (blocks / 8) + b / 8) * PANEL + l] * xd[b], *acc);
                        }
                    }
                    Data::F16(_) | Data::Bf16(_) => unreachable!("float weights take the float loop"),
                }
            }
            out.write_lanes(r, p * PANEL, &acc);
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
