//! The kernels in plain Rust: any CPU, and the definition the SIMD levels match bit for bit (the same exact
//! integer block sums, the same fused multiply-adds in the same order for each output; for float weights, the
//! same eight lanes and reduction).

use std::ops::Range;

use super::{half_f32, hsum8, k3_code, k5n_code, q6n_code, signed_codes, Acts, Data, Out, Packed, PANEL};

/// Activations to codes, per block of 32: scale `max |x| / 127`, codes rounded to nearest (ties to even), and the
/// scaled sums of the codes per 32 and per 16.
pub(super) fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32], sums_out: &mut [i32]) {
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
        super::store_scales(scale, sums, &mut d[b], &mut s32[b], &mut s16[2 * b..2 * b + 2], &mut sums_out[b]);
    }
}

/// Activations to codes per 256 (`super::quantize_supers`): llama.cpp's `quantize_row_q8_K_ref`, and the exact code
/// sums per 32 and per 16.
pub(super) fn quantize_supers(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16], sums16: &mut [i32]) {
    for (s, (x, qs)) in x.chunks_exact(256).zip(qs.chunks_exact_mut(256)).enumerate() {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        let iscale = if amax > 0.0 { -127.0 / max } else { 0.0 };
        for (q, v) in qs.iter_mut().zip(x) {
            // `as` saturates (and maps NaN to 0): a code is in -127..=127 whatever the input.
            *q = (iscale * v).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        d[s] = if amax > 0.0 { 1.0 / iscale } else { 0.0 };
        store_super_sums(qs, &mut bsums[8 * s..8 * s + 8], &mut sums16[16 * s..16 * s + 16]);
    }
}

/// The exact code sums of 256 codes per 32 and per 16.
pub(super) fn store_super_sums(qs: &[i8], bsums: &mut [i16], sums16: &mut [i32]) {
    for (g, codes) in qs.chunks_exact(16).enumerate() {
        sums16[g] = codes.iter().map(|&q| q as i32).sum();
    }
    for (j, b) in bsums.iter_mut().enumerate() {
        // At most 32 x 127 in magnitude.
        *b = (sums16[2 * j] + sums16[2 * j + 1]) as i16;
    }
}

/// The per-256 layouts (`K4`, `K5`, `Q6`, `K3`), [`run`]'s: for each output, per 256 the exact integer sums (`sum of sc x
/// sum(q x)` over its blocks of 32, for `Q6` its groups of 16 with `q - 32` (`K3`: `q - 4`); for `K4` and `K5` the mins' `sum of
/// mn x sum(x)`), then `acc = fma(sum, d_w * d_x, acc)` and for `K4`, `K5` `acc = fma(msum, -dmin_w * d_x, acc)`,
/// in order.
fn run_supers(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let (k, blocks, supers) = (w.k, w.k / 32, w.k / 256);
    assert!(x.supers, "per-256 weights with activations per 32 (a bug)");
    for p in rows.start / PANEL..rows.end.div_ceil(PANEL) {
        for r in 0..x.rows() {
            let xq = &x.qs[r * k..(r + 1) * k];
            let mut acc = [0f32; PANEL];
            for s in 0..supers {
                let (xd, ps) = (x.d[r * supers + s], p * supers + s);
                for (l, acc) in acc.iter_mut().enumerate() {
                    match &w.data {
                        Data::K4 { qs, sc, mn, d, dmin } | Data::K5 { qs, sc, mn, d, dmin } | Data::K5N { qs, sc, mn, d, dmin } => {
                            let (wide, five) = (matches!(w.data, Data::K5 { .. }), matches!(w.data, Data::K5N { .. }));
                            let (mut sum, mut msum) = (0i32, 0i32);
                            for b in 8 * s..8 * s + 8 {
                                let (pb, xb) = (p * blocks + b, &xq[32 * b..32 * b + 32]);
                                let mut dot = 0i32;
                                if five {
                                    let block = &qs[pb * 160..(pb + 1) * 160];
                                    dot = (0..8).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| k5n_code(block, g, 4 * l + j) as i32 * xb[4 * g + j] as i32).sum();
                                } else if wide {
                                    let codes = &qs[pb * 256..(pb + 1) * 256];
                                    dot = (0..8).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| codes[32 * g + 4 * l + j] as i32 * xb[4 * g + j] as i32).sum();
                                } else {
                                    let bytes = &qs[pb * 128..(pb + 1) * 128];
                                    for t in 0..4 {
                                        for j in 0..4 {
                                            let byte = bytes[32 * t + 4 * l + j];
                                            dot += (byte & 0xF) as i32 * xb[4 * t + j] as i32 + (byte >> 4) as i32 * xb[16 + 4 * t + j] as i32;
                                        }
                                    }
                                }
                                sum += sc[pb * PANEL + l] as i32 * dot;
                                msum += mn[(ps * 4 + b % 8 / 2) * 16 + 2 * l + b % 2] as i32 * x.bsums[r * blocks + b] as i32;
                            }
                            *acc = (sum as f32).mul_add(half_f32(d[ps * PANEL + l]) * xd, *acc);
                            *acc = (msum as f32).mul_add(half_f32(dmin[ps * PANEL + l]) * xd, *acc);
                        }
                        Data::Q6 { qs, sc, d } | Data::Q6N { qs, sc, d } | Data::K3 { qs, sc, d } => {
                            // K3: 3-bit codes in bit planes, standing for `c - 4`; Q6N: 192 bytes (`q6n_code`).
                            let (three, narrow, (per, offset)) = (matches!(w.data, Data::K3 { .. }), matches!(w.data, Data::Q6N { .. }), signed_codes(&w.data));
                            let mut sum = 0i32;
                            for b in 8 * s..8 * s + 8 {
                                let (pb, xb) = (p * blocks + b, &xq[32 * b..32 * b + 32]);
                                let codes = &qs[pb * per..(pb + 1) * per];
                                let code = |g: usize, at: usize| match (three, narrow) {
                                    (true, _) => k3_code(codes, g, at),
                                    (_, true) => q6n_code(codes, g, at),
                                    _ => codes[32 * g + at],
                                };
                                for h in 0..2 {
                                    let dot: i32 = (4 * h..4 * h + 4).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| code(g, 4 * l + j) as i32 * xb[4 * g + j] as i32).sum();
                                    // sum((q - 32) x) = sum(q x) - 32 sum(x) (K3: 4), times its scale.
                                    sum += sc[(2 * pb + h) * PANEL + l] as i32 * (dot - offset * x.sums16[r * 2 * blocks + 2 * b + h]);
                                }
                            }
                            *acc = (sum as f32).mul_add(d[ps * PANEL + l] * xd, *acc);
                        }
                        _ => unreachable!("run_supers of a layout per 32 (a bug)"),
                    }
                }
            }
            out.write_lanes(r, p * PANEL, &acc);
        }
    }
}

/// Weight rows `rows` (whole panels, the last possibly padded) times every activation row: for each output, per
/// block of 32 (per group of 16 for `U8` and `U5`) the exact integer sum of code products, then `acc = fma(sum, d_w
/// * d_x, acc)` and, for types with an offset, `acc = fma(m_w, s_x, acc)`, in block order; the per-256 layouts take
/// [`run_supers`].
pub(super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    if matches!(w.data, Data::K4 { .. } | Data::K5 { .. } | Data::K5N { .. } | Data::Q6 { .. } | Data::Q6N { .. } | Data::K3 { .. }) {
        return run_supers(w, rows, x, out);
    }
    assert!(!x.supers, "weights per 32 with activations per 256 (a bug)");
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
                                *acc = ((sum - 8 * x.sums[r * blocks + b]) as f32).mul_add(half_f32(d[pb * PANEL + l]) * xd[b], *acc);
                            } else {
                                *acc = (sum as f32).mul_add(half_f32(d[pb * PANEL + l]) * xd[b], *acc);
                                *acc = half_f32(m[pb * PANEL + l]).mul_add(s32[b], *acc);
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
                    Data::U5 { qs, d, m } => {
                        // `U8`'s steps, a group of 16 at a time, with the block's scale and offset for both.
                        let codes = &qs[pb * 160..(pb + 1) * 160];
                        for h in 0..2 {
                            for (l, acc) in acc.iter_mut().enumerate() {
                                let sum: i32 = (4 * h..4 * h + 4).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| k5n_code(codes, g, 4 * l + j) as i32 * xb[4 * g + j] as i32).sum();
                                let at = pb * PANEL + l;
                                *acc = (sum as f32).mul_add(d[at] * xd[b], *acc);
                                *acc = m[at].mul_add(s16[2 * b + h], *acc);
                            }
                        }
                    }
                    Data::S8 { qs, d, .. } => {
                        let codes = &qs[pb * 256..(pb + 1) * 256];
                        for (l, acc) in acc.iter_mut().enumerate() {
                            let sum: i32 = (0..8).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| (codes[32 * g + 4 * l + j] ^ 0x80) as i8 as i32 * xb[4 * g + j] as i32).sum();
                            *acc = (sum as f32).mul_add(half_f32(d[pb * PANEL + l]) * xd[b], *acc);
                        }
                    }
                    Data::S5 { qs, d } => {
                        // `S8`'s step: the codes `q - 16`.
                        let codes = &qs[pb * 160..(pb + 1) * 160];
                        for (l, acc) in acc.iter_mut().enumerate() {
                            let sum: i32 = (0..8).flat_map(|g| (0..4).map(move |j| (g, j))).map(|(g, j)| (k5n_code(codes, g, 4 * l + j) as i32 - 16) * xb[4 * g + j] as i32).sum();
                            *acc = (sum as f32).mul_add(half_f32(d[pb * PANEL + l]) * xd[b], *acc);
                        }
                    }
                    Data::Q6 { .. } | Data::Q6N { .. } | Data::K3 { .. } | Data::K4 { .. } | Data::K5 { .. } | Data::K5N { .. } => unreachable!("per-256 layouts take run_supers"),
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
