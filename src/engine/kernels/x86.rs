//! The kernels on x86-64 with AVX2 (and VNNI): the portable kernels' arithmetic, eight lanes to a register.
//!
//! One source, stamped out per instruction set by `kernels!`: the levels differ only in the 8-bit block product
//! (`idot`: unsigned codes times signed activations, four products summed per 32-bit lane): AVX2 multiplies
//! pairs to 16 bits and adds pairs of those (`vpmaddubsw`, `vpmaddwd`; the codes are at most 63 and the
//! activations at most 127 in magnitude, so the 16-bit sums, at most 2 x 63 x 127, never saturate), VNNI does
//! both in one instruction (`vpdpbusd`). Signed Q8_0 codes go through the same product as `|x|` times the code
//! with `x`'s sign (`vpsignb`); the packer refuses the code -128, whose negation would not fit.
//!
//! Safety: every function here is compiled for instructions the CPU may lack, so each is `#[target_feature]`, and
//! [`run_avx2`], [`run_vnni`] and [`quantize_blocks`] are the only ways in: they check the CPU has the level's
//! features before calling into a module. Loads go through raw pointers whose bounds the loops' slice lengths prove (see each `SAFETY`).

use std::ops::Range;

use super::{Acts, Out, Packed};

macro_rules! kernels {
    ($module:ident, $features:literal, |$w:ident, $x:ident| $idot:expr) => {
        pub(super) mod $module {
            use std::arch::x86_64::*;
            use std::ops::Range;

            use super::super::{Acts, Data, Out, Packed};

            /// Unsigned codes times signed activation codes, four products summed per lane.
            #[inline]
            #[target_feature(enable = $features)]
            fn idot($w: __m256i, $x: __m256i) -> __m256i {
                $idot
            }

            /// `hsum8` of the portable kernels, in registers.
            #[inline]
            #[target_feature(enable = $features)]
            fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<1>(t, t)))
            }

            /// `min_dot` of the portable kernels, in registers, over rows padded to a multiple of 8 values.
            #[inline]
            #[target_feature(enable = $features)]
            fn min_dot(m: &[f32], s: &[f32]) -> f32 {
                assert!(m.len() % 8 == 0 && s.len() == m.len(), "offsets not padded (a bug)");
                let mut acc = _mm256_setzero_ps();
                for c in 0..m.len() / 8 {
                    // SAFETY: `8 * c + 8 <= m.len() == s.len()`.
                    let (a, b) = unsafe { (_mm256_loadu_ps(m.as_ptr().add(8 * c)), _mm256_loadu_ps(s.as_ptr().add(8 * c))) };
                    acc = _mm256_fmadd_ps(a, b, acc);
                }
                hsum(acc)
            }

            /// Weight rows `n0..n0 + NR` times activation rows `r0..r0 + R`: each pair's own accumulator, so
            /// that a lone activation row still has `NR` independent chains of multiply-adds.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile<const NR: usize, const R: usize>(w: &Packed, n0: usize, x: &Acts, r0: usize, out: Out) {
                let (k, blocks) = (w.k, w.k / 32);
                assert!((r0 + R) * k <= x.qs.len() && (r0 + R) * blocks <= x.d.len() && (n0 + NR) <= w.n, "tile out of range (a bug)");
                let mut acc = [[_mm256_setzero_ps(); R]; NR];
                let mut min = [[0f32; R]; NR];
                // SAFETY (every use of these pointers): rows `r0..r0 + R` of the activations and `n0..n0 + NR` of
                // the weights exist (asserted above), each of `k = 32 * blocks` codes and `blocks` scales (the
                // slices below hold exactly the weight rows'), and every access is at a block `b < blocks`.
                let xq: [*const i8; R] = std::array::from_fn(|i| unsafe { x.qs.as_ptr().add((r0 + i) * k) });
                let xd: [*const f32; R] = std::array::from_fn(|i| unsafe { x.d.as_ptr().add((r0 + i) * blocks) });
                let xload = |i: usize, b: usize| unsafe { _mm256_loadu_si256(xq[i].add(32 * b).cast()) };
                let xscale = |i: usize, b: usize| unsafe { _mm256_broadcast_ss(&*xd[i].add(b)) };
                match &w.data {
                    Data::Q4 { qs, d, m } => {
                        let (qs, d) = (&qs[n0 * k / 2..(n0 + NR) * k / 2], &d[n0 * blocks..(n0 + NR) * blocks]);
                        let mask = _mm_set1_epi8(0x0F);
                        for b in 0..blocks {
                            for j in 0..NR {
                                // SAFETY: `qs` holds `NR` rows of `16 * blocks` bytes, `j < NR` and `b < blocks`.
                                let raw = unsafe { _mm_loadu_si128(qs.as_ptr().add(j * 8 * k / 16 + 16 * b).cast()) };
                                let wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(raw), mask), _mm_and_si128(raw, mask));
                                let wd = _mm256_set1_ps(d[j * blocks + b]);
                                for i in 0..R {
                                    let p = _mm256_cvtepi32_ps(idot(wv, xload(i, b)));
                                    acc[j][i] = _mm256_fmadd_ps(p, _mm256_mul_ps(wd, xscale(i, b)), acc[j][i]);
                                }
                            }
                        }
                        let stride = blocks.next_multiple_of(8);
                        for j in 0..NR {
                            for i in 0..R {
                                min[j][i] = min_dot(&m[(n0 + j) * stride..(n0 + j + 1) * stride], &x.s32[(r0 + i) * stride..(r0 + i + 1) * stride]);
                            }
                        }
                    }
                    Data::U8 { qs, d, m } => {
                        let (qs, d) = (&qs[n0 * k..(n0 + NR) * k], &d[2 * n0 * blocks..2 * (n0 + NR) * blocks]);
                        for b in 0..blocks {
                            for j in 0..NR {
                                // SAFETY: `qs` holds `NR` rows of `32 * blocks` bytes, `j < NR` and `b < blocks`.
                                let wv = unsafe { _mm256_loadu_si256(qs.as_ptr().add(j * k + 32 * b).cast()) };
                                let g = 2 * (j * blocks + b);
                                let wd = _mm256_set_m128(_mm_set1_ps(d[g + 1]), _mm_set1_ps(d[g]));
                                for i in 0..R {
                                    let p = _mm256_cvtepi32_ps(idot(wv, xload(i, b)));
                                    acc[j][i] = _mm256_fmadd_ps(p, _mm256_mul_ps(wd, xscale(i, b)), acc[j][i]);
                                }
                            }
                        }
                        let stride = (2 * blocks).next_multiple_of(8);
                        for j in 0..NR {
                            for i in 0..R {
                                min[j][i] = min_dot(&m[(n0 + j) * stride..(n0 + j + 1) * stride], &x.s16[(r0 + i) * stride..(r0 + i + 1) * stride]);
                            }
                        }
                    }
                    Data::S8 { qs, d } => {
                        let (qs, d) = (&qs[n0 * k..(n0 + NR) * k], &d[n0 * blocks..(n0 + NR) * blocks]);
                        for b in 0..blocks {
                            for j in 0..NR {
                                // SAFETY: `qs` holds `NR` rows of `32 * blocks` codes, `j < NR` and `b < blocks`.
                                let wv = unsafe { _mm256_loadu_si256(qs.as_ptr().add(j * k + 32 * b).cast()) };
                                let wd = _mm256_set1_ps(d[j * blocks + b]);
                                for i in 0..R {
                                    let xv = xload(i, b);
                                    let p = _mm256_cvtepi32_ps(idot(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv)));
                                    acc[j][i] = _mm256_fmadd_ps(p, _mm256_mul_ps(wd, xscale(i, b)), acc[j][i]);
                                }
                            }
                        }
                    }
                    Data::F16(_) | Data::Bf16(_) => unreachable!("float weights take the float tile"),
                }
                for j in 0..NR {
                    for i in 0..R {
                        out.write(r0 + i, n0 + j, hsum(acc[j][i]) + min[j][i]);
                    }
                }
            }

            /// Float weights (F16, or BF16 when `BF`): lane `l` accumulates columns `l, l + 8, ...`.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile_float<const R: usize, const BF: bool>(bits: &[u16], n: usize, x: &Acts, r0: usize, out: Out) {
                let k = x.k;
                let row = &bits[n * k..(n + 1) * k];
                let xs: [&[f32]; R] = std::array::from_fn(|i| &x.f32[(r0 + i) * k..(r0 + i + 1) * k]);
                let mut acc = [_mm256_setzero_ps(); R];
                for c in 0..k / 8 {
                    // SAFETY: `row` and each `xs[i]` hold `k` values and `8 * c + 8 <= k`.
                    let raw = unsafe { _mm_loadu_si128(row.as_ptr().add(8 * c).cast()) };
                    let wv = if BF { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw))) } else { _mm256_cvtph_ps(raw) };
                    for i in 0..R {
                        let xv = unsafe { _mm256_loadu_ps(xs[i].as_ptr().add(8 * c)) };
                        acc[i] = _mm256_fmadd_ps(wv, xv, acc[i]);
                    }
                }
                for i in 0..R {
                    out.write(r0 + i, n, hsum(acc[i]));
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn tile_any<const NR: usize, const R: usize>(w: &Packed, n0: usize, x: &Acts, r0: usize, out: Out) {
                match &w.data {
                    Data::F16(bits) => (0..NR).for_each(|j| tile_float::<R, false>(bits, n0 + j, x, r0, out)),
                    Data::Bf16(bits) => (0..NR).for_each(|j| tile_float::<R, true>(bits, n0 + j, x, r0, out)),
                    _ => tile::<NR, R>(w, n0, x, r0, out),
                }
            }

            /// Weight rows `rows` times activation rows `r0..r0 + count`, in tiles of at least four
            /// weight-row/activation-row pairs where there are enough.
            #[inline]
            #[target_feature(enable = $features)]
            fn run_panel(w: &Packed, rows: Range<usize>, x: &Acts, r0: usize, count: usize, out: Out) {
                let end = r0 + count;
                let mut n = rows.start;
                while n < rows.end {
                    // Four weight rows at a time where there are four, so that one or two activation rows left
                    // over still fill a tile.
                    let step = if rows.end - n >= 4 { 4 } else { 1 };
                    let full = r0 + (count / 4) * 4;
                    for j in 0..step {
                        for r in (r0..full).step_by(4) {
                            tile_any::<1, 4>(w, n + j, x, r, out);
                        }
                    }
                    match (end - full, step) {
                        (3, _) => (0..step).for_each(|j| tile_any::<1, 3>(w, n + j, x, full, out)),
                        (2, 4) => {
                            tile_any::<2, 2>(w, n, x, full, out);
                            tile_any::<2, 2>(w, n + 2, x, full, out);
                        }
                        (2, _) => tile_any::<1, 2>(w, n, x, full, out),
                        (1, 4) => tile_any::<4, 1>(w, n, x, full, out),
                        (1, _) => tile_any::<1, 1>(w, n, x, full, out),
                        _ => {}
                    }
                    n += step;
                }
            }

            /// Weight rows `rows` times every activation row: panels of 16 activation rows, whose codes stay in
            /// the L1 cache while the task's weight rows pass over them.
            #[target_feature(enable = $features)]
            pub(in super::super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
                let m = x.rows();
                for r0 in (0..m).step_by(16) {
                    run_panel(w, rows.clone(), x, r0, 16.min(m - r0), out);
                }
            }
        }
    };
}

kernels!(avx2, "avx2,fma,f16c", |w, x| _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
kernels!(avx512_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", |w, x| _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
kernels!(avx_vnni, "avx2,fma,f16c,avxvnni", |w, x| _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x));

/// Activation quantization, for every SIMD level (VNNI adds nothing to it).
mod quantize {
    use std::arch::x86_64::*;

    /// `quantize_blocks` of the portable code, in registers: the same bits for finite activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32]) {
        let blocks = d.len();
        assert!(x.len() == 32 * blocks && qs.len() == 32 * blocks && s32.len() == blocks && s16.len() == 2 * blocks, "activation blocks (a bug)");
        let (lo, hi, sign) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0), _mm256_set1_ps(-0.0));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for b in 0..blocks {
            // SAFETY: `x` holds `32 * blocks` values and `b < blocks`.
            let v: [__m256; 4] = std::array::from_fn(|j| unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * b + 8 * j)) });
            let a = v.map(|v| _mm256_andnot_ps(sign, v));
            let mx = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
            let scale = amax / 127.0;
            let inverse = _mm256_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
            let q = v.map(|v| {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v, inverse));
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            let lane_sum = |v: __m256i| {
                let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b00_00_00_01>(s)))
            };
            let sums = [lane_sum(_mm256_add_epi32(q[0], q[1])), lane_sum(_mm256_add_epi32(q[2], q[3]))];
            let packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            // SAFETY: `qs` holds `32 * blocks` codes and `b < blocks`.
            unsafe { _mm256_storeu_si256(qs.as_mut_ptr().add(32 * b).cast(), _mm256_permutevar8x32_epi32(packed, order)) };
            super::super::store_scales(scale, sums, &mut d[b], &mut s32[b], &mut s16[2 * b..2 * b + 2]);
        }
    }
}

fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// Activation blocks to codes at `level` (one this CPU has).
pub(super) fn quantize_blocks(level: super::Level, x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32]) {
    match level {
        super::Level::Portable => super::portable::quantize_blocks(x, qs, d, s32, s16),
        _ => {
            assert!(has_avx2(), "AVX2 kernels on a CPU without AVX2 (a bug)");
            // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
            unsafe { quantize::quantize_blocks(x, qs, d, s32, s16) }
        }
    }
}

pub(super) fn run_avx2(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    assert!(has_avx2(), "AVX2 kernels on a CPU without AVX2 (a bug)");
    // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
    unsafe { avx2::run(w, rows, x, out) }
}

pub(super) fn run_vnni(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    assert!(has_avx2(), "VNNI kernels on a CPU without AVX2 (a bug)");
    if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
        // SAFETY: the CPU has AVX2, FMA, F16C, AVX-512 VNNI and VL (checked above).
        unsafe { avx512_vnni::run(w, rows, x, out) }
    } else {
        assert!(is_x86_feature_detected!("avxvnni"), "VNNI kernels on a CPU without VNNI (a bug)");
        // SAFETY: the CPU has AVX2, FMA, F16C and AVX-VNNI (asserted above).
        unsafe { avx_vnni::run(w, rows, x, out) }
    }
}
