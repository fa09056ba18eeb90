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
//! [`run_avx2`] and [`run_vnni`] are the only ways in: they check the CPU has the level's features before calling
//! into a module. Loads go through raw pointers whose bounds the loops' slice lengths prove (see each `SAFETY`).

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

            /// Weight row `n` times activation rows `r0..r0 + R`.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile<const R: usize>(w: &Packed, n: usize, x: &Acts, r0: usize, out: Out) {
                let (k, blocks) = (w.k, w.k / 32);
                let mut acc = [_mm256_setzero_ps(); R];
                let mut min = [0f32; R];
                let xq: [&[i8]; R] = std::array::from_fn(|i| &x.qs[(r0 + i) * k..(r0 + i + 1) * k]);
                let xd: [&[f32]; R] = std::array::from_fn(|i| &x.d[(r0 + i) * blocks..(r0 + i + 1) * blocks]);
                // SAFETY (every `xload`): `xq[i]` holds `32 * blocks` codes and `b < blocks`.
                let xload = |i: usize, b: usize| unsafe { _mm256_loadu_si256(xq[i].as_ptr().add(32 * b).cast()) };
                match &w.data {
                    Data::Q4 { qs, d, m } => {
                        let (qs, d, m) = (&qs[n * k / 2..(n + 1) * k / 2], &d[n * blocks..(n + 1) * blocks], &m[n * blocks..(n + 1) * blocks]);
                        let s32: [&[f32]; R] = std::array::from_fn(|i| &x.s32[(r0 + i) * blocks..(r0 + i + 1) * blocks]);
                        let mask = _mm_set1_epi8(0x0F);
                        for b in 0..blocks {
                            // SAFETY: `qs` holds `16 * blocks` bytes and `b < blocks`.
                            let raw = unsafe { _mm_loadu_si128(qs.as_ptr().add(16 * b).cast()) };
                            let wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(raw), mask), _mm_and_si128(raw, mask));
                            for i in 0..R {
                                let p = _mm256_cvtepi32_ps(idot(wv, xload(i, b)));
                                acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(d[b] * xd[i][b]), acc[i]);
                                min[i] = m[b].mul_add(s32[i][b], min[i]);
                            }
                        }
                    }
                    Data::U8 { qs, d, m } => {
                        let (qs, d, m) = (&qs[n * k..(n + 1) * k], &d[2 * n * blocks..2 * (n + 1) * blocks], &m[2 * n * blocks..2 * (n + 1) * blocks]);
                        let s16: [&[f32]; R] = std::array::from_fn(|i| &x.s16[2 * (r0 + i) * blocks..2 * (r0 + i + 1) * blocks]);
                        for b in 0..blocks {
                            // SAFETY: `qs` holds `32 * blocks` bytes and `b < blocks`.
                            let wv = unsafe { _mm256_loadu_si256(qs.as_ptr().add(32 * b).cast()) };
                            let wd = _mm256_set_m128(_mm_set1_ps(d[2 * b + 1]), _mm_set1_ps(d[2 * b]));
                            for i in 0..R {
                                let p = _mm256_cvtepi32_ps(idot(wv, xload(i, b)));
                                acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(wd, _mm256_set1_ps(xd[i][b])), acc[i]);
                                min[i] = m[2 * b].mul_add(s16[i][2 * b], min[i]);
                                min[i] = m[2 * b + 1].mul_add(s16[i][2 * b + 1], min[i]);
                            }
                        }
                    }
                    Data::S8 { qs, d } => {
                        let (qs, d) = (&qs[n * k..(n + 1) * k], &d[n * blocks..(n + 1) * blocks]);
                        for b in 0..blocks {
                            // SAFETY: `qs` holds `32 * blocks` codes and `b < blocks`.
                            let wv = unsafe { _mm256_loadu_si256(qs.as_ptr().add(32 * b).cast()) };
                            for i in 0..R {
                                let xv = xload(i, b);
                                let p = _mm256_cvtepi32_ps(idot(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv)));
                                acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(d[b] * xd[i][b]), acc[i]);
                            }
                        }
                    }
                    Data::F16(_) | Data::Bf16(_) => unreachable!("float weights take the float tile"),
                }
                for i in 0..R {
                    out.write(r0 + i, n, hsum(acc[i]) + min[i]);
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
            fn tile_any<const R: usize>(w: &Packed, n: usize, x: &Acts, r0: usize, out: Out) {
                match &w.data {
                    Data::F16(bits) => tile_float::<R, false>(bits, n, x, r0, out),
                    Data::Bf16(bits) => tile_float::<R, true>(bits, n, x, r0, out),
                    _ => tile::<R>(w, n, x, r0, out),
                }
            }

            /// Weight rows `rows` times every activation row, four activation rows per weight row's pass.
            #[target_feature(enable = $features)]
            pub(in super::super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
                let m = x.rows();
                for n in rows {
                    let mut r = 0;
                    while r + 4 <= m {
                        tile_any::<4>(w, n, x, r, out);
                        r += 4;
                    }
                    match m - r {
                        3 => tile_any::<3>(w, n, x, r, out),
                        2 => tile_any::<2>(w, n, x, r, out),
                        1 => tile_any::<1>(w, n, x, r, out),
                        _ => {}
                    }
                }
            }
        }
    };
}

kernels!(avx2, "avx2,fma,f16c", |w, x| _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
kernels!(avx512_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", |w, x| _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
kernels!(avx_vnni, "avx2,fma,f16c,avxvnni", |w, x| _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x));

fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
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
