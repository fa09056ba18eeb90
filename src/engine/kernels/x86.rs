//! The kernels on x86-64 with AVX2 (and VNNI): the portable kernels' arithmetic, eight lanes to a register.
//!
//! One source, stamped out per instruction set by `kernels!`: the levels differ only in how 8-bit products reach
//! 32-bit sums (unsigned weight codes times signed activation codes, four products per lane): AVX2 multiplies
//! pairs to 16 bits (`vpmaddubsw`), adds a few of those while they cannot overflow, and widens (`vpmaddwd`);
//! VNNI does it in one instruction (`vpdpbusd`). Both give the exact integer sums, so the float arithmetic after
//! them, and the results, are the same. On AVX2, signed Q8_0 codes go through the same product as `|code|` times
//! `x` with the code's sign (`vpsignb`; the packer refuses the code -128, whose negation would not fit), and
//! Q5_0's (-16..=15) as `code + 16` times `x`, four groups' pairs added in 16 bits.
//!
//! The quantized weights come in panels of eight rows, four codes of each row to a 32-bit lane, so a register
//! of activation codes is one group of four broadcast (`vpbroadcastd`) and one product serves eight outputs.
//!
//! Safety: every function here is compiled for instructions the CPU may lack, so each is `#[target_feature]`, and
//! [`run_avx2`], [`run_vnni`], [`run_amx`] and [`quantize_blocks`] are the only ways in (and the AMX kernels'
//! tails, which check for themselves): they check the CPU has the level's
//! features before calling into a module. Loads go through raw pointers whose bounds the loops' slice lengths prove (see each `SAFETY`).

use std::ops::Range;

use super::{Acts, Out, Packed};

/// One module of kernels per instruction set: `vnni` says `dpbusd` is one instruction (otherwise AVX2's
/// two-step emulation, and 16-bit partial sums where they cannot overflow), `wide` that the CPU has AVX-512's 32
/// vector registers (room for tiles of two panels by four activation rows).
macro_rules! kernels {
    ($module:ident, $features:literal, vnni: $vnni:literal, wide: $wide:literal, |$acc:ident, $w:ident, $x:ident| $dpbusd:expr) => {
        pub(super) mod $module {
            use std::arch::x86_64::*;
            use std::ops::Range;

            use super::super::{Acts, Ahead, Data, Out, Packed, PANEL};

            /// `acc` plus, per 32-bit lane, the four products of unsigned codes `w` and signed codes `x`.
            #[inline]
            #[target_feature(enable = $features)]
            fn dpbusd($acc: __m256i, $w: __m256i, $x: __m256i) -> __m256i {
                $dpbusd
            }

            /// `acc` plus, per lane, the products of two pairs of code vectors, for codes of at most 6 bits: on
            /// AVX2 the two pairs' 16-bit sums (each at most 2 x 63 x 127) are added before widening, at most
            /// 32,004.
            #[inline]
            #[target_feature(enable = $features)]
            fn dot2(acc: __m256i, w0: __m256i, x0: __m256i, w1: __m256i, x1: __m256i) -> __m256i {
                if $vnni {
                    dpbusd(dpbusd(acc, w0, x0), w1, x1)
                } else {
                    let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
                    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
                }
            }

            /// `hsum8` of the portable kernels, in registers.
            #[inline]
            #[target_feature(enable = $features)]
            fn hsum(v: __m256) -> f32 {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps::<1>(t, t)))
            }

            /// A block of 4-bit codes (`Q4`'s nibble chunks, `chunk(j, t)` for panel `p0 + j`, `t < 4`) times
            /// activation rows' codes (`xg(i, g)`, group `g < 8` of row `r0 + i`): the exact 32-bit sums `sum(q x)`.
            /// VNNI: two chains of 32-bit products per output (low and high nibbles), added at the end. AVX2: 16-bit
            /// products gathered (codes of at most 15: a lane's sums over the block's eight chunks stay below 8 x 2 x
            /// 15 x 127 = 30,480), widened once.
            #[inline]
            #[target_feature(enable = $features)]
            fn nibble_dots<const P: usize, const R: usize>(chunk: impl Fn(usize, usize) -> __m256i, xg: impl Fn(usize, usize) -> __m256i) -> [[__m256i; R]; P] {
                let mask = _mm256_set1_epi8(0x0F);
                let (mut sums, mut part) = ([[_mm256_setzero_si256(); R]; P], [[_mm256_setzero_si256(); R]; P]);
                for t in 0..4 {
                    for j in 0..P {
                        let raw = chunk(j, t);
                        let (lo, hi) = (_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask));
                        for i in 0..R {
                            let (x0, x1) = (xg(i, t), xg(i, t + 4));
                            if $vnni {
                                sums[j][i] = dpbusd(sums[j][i], lo, x0);
                                part[j][i] = dpbusd(part[j][i], hi, x1);
                            } else {
                                let two = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
                                part[j][i] = _mm256_add_epi16(part[j][i], two);
                            }
                        }
                    }
                }
                std::array::from_fn(|j| std::array::from_fn(|i| if $vnni { _mm256_add_epi32(sums[j][i], part[j][i]) } else { _mm256_madd_epi16(part[j][i], _mm256_set1_epi16(1)) }))
            }

            /// A block's exact `sum(q x)` for unsigned codes of at most 5 bits (`chunk(j, g)`: panel `p0 + j`'s chunk
            /// `g < 8` as code bytes) times activation rows' codes (`xg(i, g)`: group `g` of row `r0 + i`). VNNI: two
            /// chains of products per output. AVX2: each half's four groups' 16-bit pairs (each at most 2 x 31 x 127
            /// in magnitude, four of them at most 31,496) added before widening.
            #[inline]
            #[target_feature(enable = $features)]
            fn small_dots<const P: usize, const R: usize>(chunk: impl Fn(usize, usize) -> __m256i, xg: impl Fn(usize, usize) -> __m256i) -> [[__m256i; R]; P] {
                let mut sums = [[_mm256_setzero_si256(); R]; P];
                if $vnni {
                    let mut odd = [[_mm256_setzero_si256(); R]; P];
                    for g in (0..8).step_by(2) {
                        for j in 0..P {
                            let (w0, w1) = (chunk(j, g), chunk(j, g + 1));
                            for i in 0..R {
                                sums[j][i] = dpbusd(sums[j][i], w0, xg(i, g));
                                odd[j][i] = dpbusd(odd[j][i], w1, xg(i, g + 1));
                            }
                        }
                    }
                    return std::array::from_fn(|j| std::array::from_fn(|i| _mm256_add_epi32(sums[j][i], odd[j][i])));
                }
                for half in 0..2 {
                    let mut part = [[_mm256_setzero_si256(); R]; P];
                    for g in 4 * half..4 * half + 4 {
                        for j in 0..P {
                            let wv = chunk(j, g);
                            for i in 0..R {
                                part[j][i] = _mm256_add_epi16(part[j][i], _mm256_maddubs_epi16(wv, xg(i, g)));
                            }
                        }
                    }
                    for j in 0..P {
                        for i in 0..R {
                            sums[j][i] = _mm256_add_epi32(sums[j][i], _mm256_madd_epi16(part[j][i], _mm256_set1_epi16(1)));
                        }
                    }
                }
                sums
            }

            /// `S5`'s products for panels `p0..p0 + P` (`chunk(j, b, g)`: panel `p0 + j`'s chunk `g` of block `b` as
            /// code bytes `q`; `dw(j, b)`: its scales) times activation rows (`xg(i, b, g)`; `xs(i, b)`: `16 sum(x)` of
            /// row `r0 + i`'s block `b`, and its scale): per block, the exact `sum(q x) - 16 sum(x)` ([`small_dots`]),
            /// then `acc = fma(sum, d_w * d_x, acc)`. The loop over blocks in one function, so that the accumulators
            /// stay in registers.
            #[inline]
            #[target_feature(enable = $features)]
            fn small_blocks<const P: usize, const R: usize>(
                acc: &mut [[__m256; R]; P],
                blocks: usize,
                chunk: impl Fn(usize, usize, usize) -> __m256i,
                xg: impl Fn(usize, usize, usize) -> __m256i,
                dw: impl Fn(usize, usize) -> __m256,
                xs: impl Fn(usize, usize) -> (__m256i, __m256),
            ) {
                for b in 0..blocks {
                    let sums = small_dots::<P, R>(|j, g| chunk(j, b, g), |i, g| xg(i, b, g));
                    for j in 0..P {
                        let d = dw(j, b);
                        for i in 0..R {
                            let (less, dx) = xs(i, b);
                            acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums[j][i], less)), _mm256_mul_ps(d, dx), acc[j][i]);
                        }
                    }
                }
            }

            /// `U8`'s and `U5`'s products for panels `p0..p0 + P` (`chunk(j, b, g)`: panel `p0 + j`'s chunk `g` of
            /// block `b` as code bytes; `lanes(j, b, h)`: its scales and offsets for half `h`) times activation rows
            /// (`xg(i, b, g)`; `xs(i, b, h)`: row `r0 + i`'s scale for block `b` and its code sum over half `h`): per
            /// group of 16, the exact integer sum, then `acc = fma(sum, d_w * d_x, acc)` and `acc = fma(m_w, s_x,
            /// acc)`.
            #[inline]
            #[target_feature(enable = $features)]
            fn groups16<const P: usize, const R: usize>(
                acc: &mut [[__m256; R]; P],
                blocks: usize,
                chunk: impl Fn(usize, usize, usize) -> __m256i,
                lanes: impl Fn(usize, usize, usize) -> (__m256, __m256),
                xg: impl Fn(usize, usize, usize) -> __m256i,
                xs: impl Fn(usize, usize, usize) -> (__m256, __m256),
            ) {
                for b in 0..blocks {
                    for h in 0..2 {
                        let mut sums = [[_mm256_setzero_si256(); R]; P];
                        for g in (4 * h..4 * h + 4).step_by(2) {
                            for j in 0..P {
                                let (w0, w1) = (chunk(j, b, g), chunk(j, b, g + 1));
                                for i in 0..R {
                                    sums[j][i] = dot2(sums[j][i], w0, xg(i, b, g), w1, xg(i, b, g + 1));
                                }
                            }
                        }
                        for j in 0..P {
                            let (dw, mw) = lanes(j, b, h);
                            for i in 0..R {
                                let (dx, sx) = xs(i, b, h);
                                acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j][i]), _mm256_mul_ps(dw, dx), acc[j][i]);
                                acc[j][i] = _mm256_fmadd_ps(mw, sx, acc[j][i]);
                            }
                        }
                    }
                }
            }

            /// `Data::Q6N`'s chunk `g` (of 8) of the panel and block whose 192 bytes start at `at`: the 32 code
            /// bytes `Q6` holds there. Chunks 0..4 are their bytes' low six bits; chunk `4 + t` takes its high two
            /// bits from the top of chunk `t`'s bytes and its low four from a nibble.
            ///
            /// Safety: the 192 bytes from `at` are readable.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q6n_chunk(at: *const u8, g: usize) -> __m256i {
                // SAFETY: bytes `32 (g % 4)..` and `128 + 32 (g % 4 / 2)..`, 32 each, lie within the 192 (`g < 8`).
                let whole = unsafe { _mm256_loadu_si256(at.add(32 * (g % 4)).cast()) };
                if g < 4 {
                    return _mm256_and_si256(whole, _mm256_set1_epi8(0x3F));
                }
                let nibbles = unsafe { _mm256_loadu_si256(at.add(128 + 32 * (g % 4 / 2)).cast()) };
                let low = if g % 2 == 0 { nibbles } else { _mm256_srli_epi16::<4>(nibbles) };
                // Bits 6 and 7 of each byte moved to 4 and 5 (a shift of 16-bit words: the mask keeps each byte's own
                // bits).
                let high = _mm256_srli_epi16::<2>(whole);
                _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)), _mm256_and_si256(high, _mm256_set1_epi8(0x30)))
            }

            /// `Data::K5N`'s chunk `g` (of 8) of the panel and block whose 160 bytes start at `at`: the 32 code
            /// bytes `K5` holds there. Chunks 0..4 are their bytes' low five bits; chunk `4 + t` takes its low three
            /// bits from the top of chunk `t`'s bytes and its high two from bits `2 t`, `2 t + 1` of bytes `128..`.
            ///
            /// Safety: the 160 bytes from `at` are readable.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k5n_chunk(at: *const u8, g: usize) -> __m256i {
                // SAFETY: bytes `32 (g % 4)..` and `128..`, 32 each, lie within the 160 (`g < 8`).
                let whole = unsafe { _mm256_loadu_si256(at.add(32 * (g % 4)).cast()) };
                if g < 4 {
                    return _mm256_and_si256(whole, _mm256_set1_epi8(0x1F));
                }
                let pairs = unsafe { _mm256_loadu_si256(at.add(128).cast()) };
                // Shifts of 16-bit words; each mask keeps each byte's own bits: bits 5-7 to 0-2, bits `2 t`, `2 t + 1`
                // to 3-4.
                let low = _mm256_and_si256(_mm256_srli_epi16::<5>(whole), _mm256_set1_epi8(0x07));
                let t = (g - 4) as i32;
                let high = if t < 2 { _mm256_sll_epi16(pairs, _mm_cvtsi32_si128(3 - 2 * t)) } else { _mm256_srl_epi16(pairs, _mm_cvtsi32_si128(2 * t - 3)) };
                _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x18)))
            }

            /// Panels `panels` of a `Data::Q6N`, `Data::K5N`, `Data::U5` or `Data::S5` matrix with `blocks` blocks
            /// of 32 a row, as code bytes (256 per panel and block, `Q6`'s, `K5`'s or `U8`'s) into `into`, from its
            /// start.
            #[target_feature(enable = $features)]
            fn unpack_narrow(data: &Data, blocks: usize, panels: Range<usize>, into: &mut [u8]) {
                let Some((qs, per)) = super::super::narrow_bytes(data) else { unreachable!("unpack_narrow of a wide layout (a bug)") };
                let six = matches!(data, Data::Q6N { .. });
                let (from, count) = (panels.start * blocks, panels.len() * blocks);
                assert!((from + count) * per <= qs.len() && count * 256 <= into.len(), "narrow panels out of range (a bug)");
                for i in 0..count {
                    for g in 0..8 {
                        // SAFETY: panel and block `from + i` has its `per` bytes (192 for Q6N, 160 for the others) in
                        // `qs`, and bytes `256 i + 32 g..` (32) lie within `into` (both asserted above).
                        unsafe {
                            let at = qs.as_ptr().add((from + i) * per);
                            _mm256_storeu_si256(into.as_mut_ptr().add(256 * i + 32 * g).cast(), if six { q6n_chunk(at, g) } else { k5n_chunk(at, g) });
                        }
                    }
                }
            }

            /// Panels `p0..p0 + P` of weight rows times activation rows `r0..r0 + R`: one register of eight
            /// outputs per panel and activation row. `unpacked`, when not empty, holds a `Data::Q6N` or `Data::K5N`
            /// matrix's codes as `Q6`'s or `K5`'s bytes from panel `first` on ([`unpack_narrow`]), read in place of
            /// its own.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile<const P: usize, const R: usize>(w: &Packed, p0: usize, x: &Acts, r0: usize, out: Out, (unpacked, first): (&[u8], usize)) {
                let (k, blocks) = (w.k, w.k / 32);
                let panels = w.n.div_ceil(PANEL);
                // Activation scales per row: per block of 32, or per 256 (`x.supers`, the per-256 layouts).
                let per_row = if x.supers { blocks / 8 } else { blocks };
                assert!(p0 + P <= panels && (r0 + R) * k <= x.qs.len() && (r0 + R) * per_row <= x.d.len(), "tile out of range (a bug)");
                assert!(x.supers || x.s32.len() == x.d.len() && x.s16.len() == 2 * x.d.len(), "activation sums (a bug)");
                let mut acc = [[_mm256_setzero_ps(); R]; P];
                // SAFETY (every use of these pointers and closures): activation rows `r0..r0 + R` exist (asserted
                // above), each of `k = 32 * blocks` codes and `per_row` scales; per 32 (`!x.supers`, asserted by
                // each arm that reads them), `blocks` sums per 32 and `2 * blocks` per 16; every access is at a
                // block `b < blocks` (a 256 `b < per_row` for `xd` of `x.supers`), a group `g < 8` of 4 codes in
                // it, a half `h < 2`.
                let xq: [*const i8; R] = std::array::from_fn(|i| unsafe { x.qs.as_ptr().add((r0 + i) * k) });
                let xg = |i: usize, b: usize, g: usize| unsafe { _mm256_set1_epi32(xq[i].add(32 * b + 4 * g).cast::<i32>().read_unaligned()) };
                let xd = |i: usize, b: usize| unsafe { _mm256_broadcast_ss(&*x.d.as_ptr().add((r0 + i) * per_row + b)) };
                let s32 = |i: usize, b: usize| unsafe { _mm256_broadcast_ss(&*x.s32.as_ptr().add((r0 + i) * blocks + b)) };
                let s16 = |i: usize, b: usize, h: usize| unsafe { _mm256_broadcast_ss(&*x.s16.as_ptr().add((r0 + i) * 2 * blocks + 2 * b + h)) };
                match &w.data {
                    Data::Q4 { qs, d, m } => {
                        assert!(!x.supers, "activations per 256 for a layout per 32 (a bug)");
                        let signed = m.is_empty();
                        assert!(qs.len() == panels * blocks * 128 && d.len() == panels * blocks * PANEL && (signed || m.len() == d.len()), "Q4 layout (a bug)");
                        assert!(x.sums.len() == x.d.len(), "activation code sums (a bug)");
                        // SAFETY: activation row `r0 + i < r0 + R` exists and `b < blocks` (as for `xd`).
                        let xsum = |i: usize, b: usize| unsafe { *x.sums.as_ptr().add((r0 + i) * blocks + b) };
                        // SAFETY (these closures): panel `p < panels` and block `b < blocks` (the loops' bounds) are
                        // within the lengths asserted above: 128 code bytes and 8 scales and offsets each.
                        let chunk = |p: usize, b: usize, t: usize| unsafe { _mm256_loadu_si256(qs.as_ptr().add((p * blocks + b) * 128 + 32 * t).cast()) };
                        let lanes = |v: &[u16], p: usize, b: usize| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add((p * blocks + b) * PANEL).cast())) };
                        for b in 0..blocks {
                            let sums = nibble_dots::<P, R>(|j, t| chunk(p0 + j, b, t), |i, g| xg(i, b, g));
                            if signed {
                                // Q4_0: sum((code - 8) x) = sum(code x) - 8 sum(x), exact; no offset step.
                                for j in 0..P {
                                    let dw = lanes(d, p0 + j, b);
                                    for i in 0..R {
                                        let sum = _mm256_sub_epi32(sums[j][i], _mm256_set1_epi32(8 * xsum(i, b)));
                                        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, xd(i, b)), acc[j][i]);
                                    }
                                }
                                continue;
                            }
                            for j in 0..P {
                                let (dw, mw) = (lanes(d, p0 + j, b), lanes(m, p0 + j, b));
                                for i in 0..R {
                                    acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j][i]), _mm256_mul_ps(dw, xd(i, b)), acc[j][i]);
                                    acc[j][i] = _mm256_fmadd_ps(mw, s32(i, b), acc[j][i]);
                                }
                            }
                        }
                    }
                    Data::U8 { .. } | Data::U5 { .. } => {
                        assert!(!x.supers, "activations per 256 for a layout per 32 (a bug)");
                        // U8: 256 code bytes and 16 f32 scales and offsets (a pair per half) per panel and block; U5:
                        // 160 code bytes (`k5n_chunk`), or `unpacked`'s 256, and 8 f32 scales and offsets. Each case
                        // its own loop (`groups16`).
                        // SAFETY (these closures): panel `p0 + j < panels`, block `b < blocks`, chunk `g < 8` and
                        // half `h < 2` (the loops' bounds) are within the lengths asserted in each arm: the code bytes
                        // per panel and block (U5's chunks all from its 160, `k5n_chunk`) and the scales and offsets
                        // (U8: 16, U5: 8); `unpacked`'s 256 bytes per panel and block for panels `first..p0 + P`.
                        let xs = |i: usize, b: usize, h: usize| (xd(i, b), s16(i, b, h));
                        match &w.data {
                            Data::U8 { qs, d, m } => {
                                assert!(qs.len() == panels * blocks * 256 && d.len() == panels * blocks * 2 * PANEL && m.len() == d.len(), "U8 layout (a bug)");
                                let chunk = |j: usize, b: usize, g: usize| unsafe { _mm256_loadu_si256(qs.as_ptr().add(((p0 + j) * blocks + b) * 256 + 32 * g).cast()) };
                                let lanes = |j: usize, b: usize, h: usize| unsafe {
                                    let at = (((p0 + j) * blocks + b) * 2 + h) * PANEL;
                                    (_mm256_loadu_ps(d.as_ptr().add(at)), _mm256_loadu_ps(m.as_ptr().add(at)))
                                };
                                groups16::<P, R>(&mut acc, blocks, chunk, lanes, xg, xs);
                            }
                            Data::U5 { qs, d, m } => {
                                assert!(qs.len() == panels * blocks * 160 && d.len() == panels * blocks * PANEL && m.len() == d.len(), "U5 layout (a bug)");
                                assert!(unpacked.is_empty() || p0 >= first && (p0 + P - first) * blocks * 256 <= unpacked.len(), "U5's unpacked codes (a bug)");
                                // The block's scales and offsets for both halves.
                                let lanes = |j: usize, b: usize, _: usize| unsafe {
                                    let at = ((p0 + j) * blocks + b) * PANEL;
                                    (_mm256_loadu_ps(d.as_ptr().add(at)), _mm256_loadu_ps(m.as_ptr().add(at)))
                                };
                                if unpacked.is_empty() {
                                    let chunk = |j: usize, b: usize, g: usize| unsafe { k5n_chunk(qs.as_ptr().add(((p0 + j) * blocks + b) * 160), g) };
                                    groups16::<P, R>(&mut acc, blocks, chunk, lanes, xg, xs);
                                } else {
                                    let chunk = |j: usize, b: usize, g: usize| unsafe { _mm256_loadu_si256(unpacked.as_ptr().add(((p0 + j - first) * blocks + b) * 256 + 32 * g).cast()) };
                                    groups16::<P, R>(&mut acc, blocks, chunk, lanes, xg, xs);
                                }
                            }
                            _ => unreachable!("U8 or U5"),
                        }
                    }
                    Data::S8 { qs, d, small } => {
                        assert!(!x.supers, "activations per 256 for a layout per 32 (a bug)");
                        assert!(qs.len() == panels * blocks * 256 && d.len() == panels * blocks * PANEL, "S8 layout (a bug)");
                        // SAFETY (these closures): as for U8, with 8 scales per panel and block.
                        let chunk = |p: usize, b: usize, g: usize| unsafe { _mm256_loadu_si256(qs.as_ptr().add((p * blocks + b) * 256 + 32 * g).cast()) };
                        let lanes = |p: usize, b: usize| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add((p * blocks + b) * PANEL).cast())) };
                        assert!(x.sums.len() == x.d.len(), "activation code sums (a bug)");
                        // SAFETY: activation row `r0 + i < r0 + R` exists and `b < blocks` (as for `xd`).
                        let xsum = |i: usize, b: usize| unsafe { *x.sums.as_ptr().add((r0 + i) * blocks + b) };
                        let flip = _mm256_set1_epi8(-128);
                        for b in 0..blocks {
                            let mut sums = [[_mm256_setzero_si256(); R]; P];
                            if $vnni {
                                // The stored bytes, code + 128, as unsigned: sum((code + 128) x) - 128 sum(x),
                                // two chains of products per output.
                                let mut odd = [[_mm256_setzero_si256(); R]; P];
                                for g in (0..8).step_by(2) {
                                    for j in 0..P {
                                        let (w0, w1) = (chunk(p0 + j, b, g), chunk(p0 + j, b, g + 1));
                                        for i in 0..R {
                                            sums[j][i] = dpbusd(sums[j][i], w0, xg(i, b, g));
                                            odd[j][i] = dpbusd(odd[j][i], w1, xg(i, b, g + 1));
                                        }
                                    }
                                }
                                for j in 0..P {
                                    for i in 0..R {
                                        sums[j][i] = _mm256_sub_epi32(_mm256_add_epi32(sums[j][i], odd[j][i]), _mm256_set1_epi32(128 * xsum(i, b)));
                                    }
                                }
                            } else if *small {
                                // Codes in -16..=15 (Q5_0's): `code + 16` (the stored byte less 112) is 0..=31, an
                                // unsigned product's pair at most 2 x 31 x 127 = 7,874 in magnitude, so four
                                // groups' pairs add up in 16 bits (at most 31,496) before widening (`small_dots`):
                                // sum(code x) = sum((code + 16) x) - 16 sum(x), exact.
                                let less = _mm256_set1_epi8(112);
                                sums = small_dots::<P, R>(|j, g| _mm256_sub_epi8(chunk(p0 + j, b, g), less), |i, g| xg(i, b, g));
                                for j in 0..P {
                                    for i in 0..R {
                                        sums[j][i] = _mm256_sub_epi32(sums[j][i], _mm256_set1_epi32(16 * xsum(i, b)));
                                    }
                                }
                            } else {
                                for g in 0..8 {
                                    for j in 0..P {
                                        let wv = _mm256_xor_si256(chunk(p0 + j, b, g), flip);
                                        // Signed times signed as |code| times x with the code's sign (0 where the
                                        // code is 0): |code| once per panel, for every row. The codes are in
                                        // -127..=127 (the packer refuses -128), the activations' too, so the
                                        // negation fits, and a pair of products, at most 2 x 127 x 127, fits 16
                                        // bits.
                                        let magnitude = _mm256_abs_epi8(wv);
                                        for i in 0..R {
                                            sums[j][i] = dpbusd(sums[j][i], magnitude, _mm256_sign_epi8(xg(i, b, g), wv));
                                        }
                                    }
                                }
                            }
                            for j in 0..P {
                                let dw = lanes(p0 + j, b);
                                for i in 0..R {
                                    acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j][i]), _mm256_mul_ps(dw, xd(i, b)), acc[j][i]);
                                }
                            }
                        }
                    }
                    Data::S5 { qs, d } => {
                        assert!(!x.supers, "activations per 256 for a layout per 32 (a bug)");
                        assert!(qs.len() == panels * blocks * 160 && d.len() == panels * blocks * PANEL, "S5 layout (a bug)");
                        assert!(unpacked.is_empty() || p0 >= first && (p0 + P - first) * blocks * 256 <= unpacked.len(), "S5's unpacked codes (a bug)");
                        assert!(x.sums.len() == x.d.len(), "activation code sums (a bug)");
                        // SAFETY (these closures): activation row `r0 + i < r0 + R` exists and `b < blocks` (as for
                        // `xd`); panel `p0 + j < panels`, block `b < blocks` and chunk `g < 8` (the loops' bounds) are
                        // within the lengths asserted above: 160 code bytes (`k5n_chunk`) and 8 scales per panel and
                        // block; `unpacked`'s 256 bytes per panel and block for panels `first..p0 + P`.
                        let xsum = |i: usize, b: usize| unsafe { *x.sums.as_ptr().add((r0 + i) * blocks + b) };
                        let lanes = |p: usize, b: usize| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add((p * blocks + b) * PANEL).cast())) };
                        // `S8`'s small codes' step: sum((q - 16) x) = sum(q x) - 16 sum(x), exact, then the float step.
                        let less = |i: usize, b: usize| _mm256_set1_epi32(16 * xsum(i, b));
                        let xs = |i: usize, b: usize| (less(i, b), xd(i, b));
                        // Each source of codes its own loop (a closure choosing per chunk took up to twice the time).
                        if unpacked.is_empty() {
                            small_blocks::<P, R>(&mut acc, blocks, |j, b, g| unsafe { k5n_chunk(qs.as_ptr().add(((p0 + j) * blocks + b) * 160), g) }, xg, |j, b| lanes(p0 + j, b), xs);
                        } else {
                            let chunk = |j: usize, b: usize, g: usize| unsafe { _mm256_loadu_si256(unpacked.as_ptr().add(((p0 + j - first) * blocks + b) * 256 + 32 * g).cast()) };
                            small_blocks::<P, R>(&mut acc, blocks, chunk, xg, |j, b| lanes(p0 + j, b), xs);
                        }
                    }
                    Data::Q6 { qs, sc, d } | Data::Q6N { qs, sc, d } | Data::K3 { qs, sc, d } => {
                        let supers = blocks / 8;
                        // K3: 96 bytes of bit planes per panel and block, codes standing for `c - 4`. Q6N: 192 bytes
                        // (`q6n_chunk`), or `unpacked`'s 256.
                        let (three, narrow) = (matches!(w.data, Data::K3 { .. }), matches!(w.data, Data::Q6N { .. }) && unpacked.is_empty());
                        let (per, offset) = super::super::signed_codes(&w.data);
                        assert!(x.supers && x.sums16.len() == 2 * x.rows() * blocks, "Q6 takes activations per 256 (a bug)");
                        assert!(blocks.is_multiple_of(8) && qs.len() == panels * blocks * per && sc.len() == panels * blocks * 2 * PANEL && d.len() == panels * supers * PANEL, "Q6 layout (a bug)");
                        assert!(unpacked.is_empty() || matches!(w.data, Data::Q6N { .. }) && p0 >= first && (p0 + P - first) * blocks * 256 <= unpacked.len(), "Q6N's unpacked codes (a bug)");
                        let (low2, low1) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
                        // SAFETY (these closures): as for U8, with `per` code bytes (K3: chunk `g < 8`'s low bits
                        // at `32 (g / 4)`, the high bits at 64, 32 bytes each; Q6N: 192 bytes, `q6n_chunk`'s), 16
                        // scale bytes per panel and block and 8 scales per panel and 256 (`s < supers`); `unpacked`'s
                        // 256 bytes per panel and block for panels `first..p0 + P` (asserted above).
                        let chunk = |p: usize, b: usize, g: usize| unsafe {
                            let at = qs.as_ptr().add((p * blocks + b) * per);
                            if !unpacked.is_empty() {
                                _mm256_loadu_si256(unpacked.as_ptr().add(((p - first) * blocks + b) * 256 + 32 * g).cast())
                            } else if narrow {
                                q6n_chunk(at, g)
                            } else if three {
                                // Bits `2 (g % 4)` of the low plane, bit `g` of the high plane moved to bit 2: shifts of
                                // 16-bit words, each byte masked to its own bits.
                                let lo = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(at.add(32 * (g / 4)).cast()), _mm_cvtsi32_si128(2 * (g % 4) as i32)), low2);
                                let hi = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(at.add(64).cast()), _mm_cvtsi32_si128(g as i32)), low1);
                                _mm256_or_si256(lo, _mm256_slli_epi16::<2>(hi))
                            } else {
                                _mm256_loadu_si256(at.add(32 * g).cast())
                            }
                        };
                        let scales = |p: usize, b: usize| unsafe { _mm_loadu_si128(sc.as_ptr().add((p * blocks + b) * 2 * PANEL).cast()) };
                        let lanes = |p: usize, s: usize| unsafe { _mm256_loadu_ps(d.as_ptr().add((p * supers + s) * PANEL)) };
                        if !$vnni {
                            // AVX2: each pair of groups' 16-bit sums (at most 2 x 2 x 63 x 127 = 32,004) times its
                            // half's scale, widened by the same `vpmaddwd` (llama.cpp's order of work), added in
                            // 32 bits; the offset's `sc x offset x sum(x)` per block once, as a 16-bit pair of
                            // halves (sums of 16 codes, at most 2,032), taken off per 256. The same exact integers
                            // as VNNI's chains below, so the same bits.
                            // The low two bytes of each 32-bit lane, twice: a scale widened to 32 bits becomes the
                            // same 16-bit scale in both halves of its lane.
                            let twice = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
                            // SAFETY: activation row `r0 + i < r0 + R` exists and `b < blocks` (`sums16` is `[m, 2
                            // blocks]`, asserted above).
                            let halves = |i: usize, b: usize| unsafe {
                                let at = x.sums16.as_ptr().add((r0 + i) * 2 * blocks + 2 * b);
                                _mm256_set1_epi32((*at & 0xFFFF) | (*at.add(1) << 16))
                            };
                            for s in 0..supers {
                                let (mut total, mut offsets) = ([[_mm256_setzero_si256(); R]; P], [[_mm256_setzero_si256(); R]; P]);
                                for b in 8 * s..8 * s + 8 {
                                    for j in 0..P {
                                        let sv = scales(p0 + j, b);
                                        // Lane `l`: its two halves' scales as a 16-bit pair, for the offset; and each half's
                                        // scale in both 16-bit halves of the lane, for the products.
                                        let pair = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sv, _mm_srli_si128::<8>(sv)));
                                        let scale = [_mm256_shuffle_epi8(_mm256_cvtepi8_epi32(sv), twice), _mm256_shuffle_epi8(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sv)), twice)];
                                        for h in 0..2 {
                                            for g in (4 * h..4 * h + 4).step_by(2) {
                                                let (w0, w1) = (chunk(p0 + j, b, g), chunk(p0 + j, b, g + 1));
                                                for i in 0..R {
                                                    let two = _mm256_add_epi16(_mm256_maddubs_epi16(w0, xg(i, b, g)), _mm256_maddubs_epi16(w1, xg(i, b, g + 1)));
                                                    total[j][i] = _mm256_add_epi32(total[j][i], _mm256_madd_epi16(two, scale[h]));
                                                }
                                            }
                                        }
                                        for i in 0..R {
                                            offsets[j][i] = _mm256_add_epi32(offsets[j][i], _mm256_madd_epi16(pair, halves(i, b)));
                                        }
                                    }
                                }
                                for j in 0..P {
                                    let dw = lanes(p0 + j, s);
                                    for i in 0..R {
                                        let sum = _mm256_sub_epi32(total[j][i], _mm256_mullo_epi32(offsets[j][i], _mm256_set1_epi32(offset)));
                                        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, xd(i, s)), acc[j][i]);
                                    }
                                }
                            }
                        } else {
                            // SAFETY: activation row `r0 + i < r0 + R` exists, `b < blocks` and `h < 2` (`sums16` is
                            // `[m, 2 blocks]`, asserted above).
                            let less = |i: usize, b: usize, h: usize| unsafe { _mm256_set1_epi32(offset * *x.sums16.as_ptr().add((r0 + i) * 2 * blocks + 2 * b + h)) };
                            for s in 0..supers {
                                let mut total = [[_mm256_setzero_si256(); R]; P];
                                for b in 8 * s..8 * s + 8 {
                                    // Both halves' chains side by side: `sums[h]` is sum(q x) over half `h`.
                                    let mut sums = [[[_mm256_setzero_si256(); R]; P]; 2];
                                    for g in (0..4).step_by(2) {
                                        for j in 0..P {
                                            for (h, sums) in sums.iter_mut().enumerate() {
                                                let (w0, w1) = (chunk(p0 + j, b, 4 * h + g), chunk(p0 + j, b, 4 * h + g + 1));
                                                for i in 0..R {
                                                    sums[j][i] = dot2(sums[j][i], w0, xg(i, b, 4 * h + g), w1, xg(i, b, 4 * h + g + 1));
                                                }
                                            }
                                        }
                                    }
                                    for j in 0..P {
                                        let sv = scales(p0 + j, b);
                                        let (s0, s1) = (_mm256_cvtepi8_epi32(sv), _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sv)));
                                        for i in 0..R {
                                            // `sc_0 * (sum(q x) - 32 sum(x)) + sc_1 * (...)` (K3: 4), exact in 32 bits.
                                            let (h0, h1) = (_mm256_sub_epi32(sums[0][j][i], less(i, b, 0)), _mm256_sub_epi32(sums[1][j][i], less(i, b, 1)));
                                            total[j][i] = _mm256_add_epi32(total[j][i], _mm256_add_epi32(_mm256_mullo_epi32(h0, s0), _mm256_mullo_epi32(h1, s1)));
                                        }
                                    }
                                }
                                for j in 0..P {
                                    let dw = lanes(p0 + j, s);
                                    for i in 0..R {
                                        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[j][i]), _mm256_mul_ps(dw, xd(i, s)), acc[j][i]);
                                    }
                                }
                            }
                        }
                    }
                    Data::K4 { qs, sc, mn, d, dmin } | Data::K5 { qs, sc, mn, d, dmin } | Data::K5N { qs, sc, mn, d, dmin } => {
                        let supers = blocks / 8;
                        // K5: codes one per byte (`U8`'s chunks), else nibbles (`Q4`'s); K5N: `K5`'s chunks from its 160
                        // bytes (`k5n_chunk`), or `unpacked`'s 256.
                        let (five, wide) = (matches!(w.data, Data::K5N { .. }), !matches!(w.data, Data::K4 { .. }));
                        let per = match w.data {
                            Data::K5 { .. } => 256,
                            Data::K5N { .. } => 160,
                            _ => 128,
                        };
                        assert!(unpacked.is_empty() || five && p0 >= first && (p0 + P - first) * blocks * 256 <= unpacked.len(), "K5N's unpacked codes (a bug)");
                        assert!(x.supers && x.bsums.len() == x.rows() * blocks, "K4 takes activations per 256 (a bug)");
                        assert!(qs.len() == panels * blocks * per && sc.len() == panels * blocks * PANEL && mn.len() == panels * supers * 64 && d.len() == panels * supers * PANEL && dmin.len() == d.len(), "K4 layout (a bug)");
                        // SAFETY (these closures): panel `p < panels`, block `b < blocks`, 256 `s < supers`, pair `t <
                        // 4`, chunk `t < 4` (K4) or `t < 8` (K5, K5N) (the loops' bounds) are within the lengths
                        // asserted above: `per` code bytes (K5N's chunks all from its 160, `k5n_chunk`) and 8 scales
                        // per panel and block, 64 mins and 8 of `d` and `dmin` per panel and 256; `unpacked`'s 256
                        // bytes per panel and block for panels `first..p0 + P` (asserted above).
                        let chunk = |p: usize, b: usize, t: usize| unsafe {
                            if !unpacked.is_empty() {
                                _mm256_loadu_si256(unpacked.as_ptr().add(((p - first) * blocks + b) * 256 + 32 * t).cast())
                            } else if five {
                                k5n_chunk(qs.as_ptr().add((p * blocks + b) * per), t)
                            } else {
                                _mm256_loadu_si256(qs.as_ptr().add((p * blocks + b) * per + 32 * t).cast())
                            }
                        };
                        let scales = |p: usize, b: usize| unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.as_ptr().add((p * blocks + b) * PANEL).cast())) };
                        let mins = |p: usize, s: usize, t: usize| unsafe { _mm256_cvtepu8_epi16(_mm_loadu_si128(mn.as_ptr().add(((p * supers + s) * 4 + t) * 16).cast())) };
                        let lanes = |v: &[u16], p: usize, s: usize| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add((p * supers + s) * PANEL).cast())) };
                        // SAFETY: activation row `r0 + i < r0 + R` exists and `8 s + 2 t + 1 < blocks` (`bsums` is `[m,
                        // blocks]`, asserted above): blocks `2t` and `2t + 1` of the 256's code sums, one 32-bit lane.
                        let pair = |i: usize, s: usize, t: usize| unsafe { _mm256_set1_epi32(x.bsums.as_ptr().add((r0 + i) * blocks + 8 * s + 2 * t).cast::<i32>().read_unaligned()) };
                        for s in 0..supers {
                            let mut total = [[_mm256_setzero_si256(); R]; P];
                            for b in 8 * s..8 * s + 8 {
                                // The block's sum(q x) as Q4's (K5: as U8's), then times its scale, exact in 32 bits.
                                let (mut sums, mut part) = ([[_mm256_setzero_si256(); R]; P], [[_mm256_setzero_si256(); R]; P]);
                                if !wide {
                                    // Q4's sums, whole (`part` stays zero).
                                    sums = nibble_dots::<P, R>(|j, t| chunk(p0 + j, b, t), |i, g| xg(i, b, g));
                                } else {
                                    // Two chains of `dot2`'s exact 32-bit sums: chunk pairs (0, 1) and (4, 5), (2, 3) and (6, 7).
                                    for g in (0..8).step_by(2) {
                                        for j in 0..P {
                                            let (w0, w1) = (chunk(p0 + j, b, g), chunk(p0 + j, b, g + 1));
                                            for i in 0..R {
                                                if g % 4 == 0 {
                                                    sums[j][i] = dot2(sums[j][i], w0, xg(i, b, g), w1, xg(i, b, g + 1));
                                                } else {
                                                    part[j][i] = dot2(part[j][i], w0, xg(i, b, g), w1, xg(i, b, g + 1));
                                                }
                                            }
                                        }
                                    }
                                }
                                for j in 0..P {
                                    let sv = scales(p0 + j, b);
                                    for i in 0..R {
                                        let dot = _mm256_add_epi32(sums[j][i], part[j][i]);
                                        total[j][i] = _mm256_add_epi32(total[j][i], _mm256_mullo_epi32(dot, sv));
                                    }
                                }
                            }
                            for j in 0..P {
                                let (dw, mw) = (lanes(d, p0 + j, s), lanes(dmin, p0 + j, s));
                                for i in 0..R {
                                    // The mins: per lane, sum over the 8 blocks of mn x sum(x), as 16-bit pairs.
                                    let mut msum = _mm256_madd_epi16(mins(p0 + j, s, 0), pair(i, s, 0));
                                    for t in 1..4 {
                                        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins(p0 + j, s, t), pair(i, s, t)));
                                    }
                                    let xs = xd(i, s);
                                    acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[j][i]), _mm256_mul_ps(dw, xs), acc[j][i]);
                                    acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(mw, xs), acc[j][i]);
                                }
                            }
                        }
                    }
                    Data::F16(_) | Data::Bf16(_) => unreachable!("float weights take the float tile"),
                }
                // SAFETY: `store_tile` hands each output's eight floats, this task's to write.
                if out.store_tile::<P, R>(p0, r0, |j, i, at| unsafe { _mm256_storeu_ps(at, acc[j][i]) }) {
                    return;
                }
                for j in 0..P {
                    for i in 0..R {
                        let mut values = [0f32; PANEL];
                        // SAFETY: `values` holds 8 f32.
                        unsafe { _mm256_storeu_ps(values.as_mut_ptr(), acc[j][i]) };
                        out.write_lanes(r0 + i, (p0 + j) * PANEL, &values);
                    }
                }
            }

            /// Float weights (F16, or BF16 when `BF`): lane `l` accumulates columns `l, l + 8, ...`.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile_float<const N: usize, const R: usize, const BF: bool>(bits: &[u16], n0: usize, x: &Acts, r0: usize, out: Out) {
                let k = x.k;
                let rows: [&[u16]; N] = std::array::from_fn(|j| &bits[(n0 + j) * k..(n0 + j + 1) * k]);
                let xs: [&[f32]; R] = std::array::from_fn(|i| &x.f32[(r0 + i) * k..(r0 + i + 1) * k]);
                let mut acc = [[_mm256_setzero_ps(); R]; N];
                for c in 0..k / 8 {
                    // SAFETY: each of `rows` and `xs` holds `k` values and `8 * c + 8 <= k`.
                    let wv: [__m256; N] = std::array::from_fn(|j| {
                        let raw = unsafe { _mm_loadu_si128(rows[j].as_ptr().add(8 * c).cast()) };
                        if BF { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw))) } else { _mm256_cvtph_ps(raw) }
                    });
                    for i in 0..R {
                        let xv = unsafe { _mm256_loadu_ps(xs[i].as_ptr().add(8 * c)) };
                        for j in 0..N {
                            acc[j][i] = _mm256_fmadd_ps(wv[j], xv, acc[j][i]);
                        }
                    }
                }
                for j in 0..N {
                    for i in 0..R {
                        out.write(r0 + i, n0 + j, hsum(acc[j][i]));
                    }
                }
            }

            /// Float weight rows `rows` times activation rows `r..r + R`: several weight rows a tile, so that each
            /// activation load serves them all and the tile has `N x R` independent chains of multiply-adds (a lone
            /// decode row had one chain, latency-bound). Each output's own chain is the same whatever the tile.
            #[inline]
            #[target_feature(enable = $features)]
            fn float_rows<const R: usize, const BF: bool>(bits: &[u16], rows: Range<usize>, x: &Acts, r: usize, out: Out) {
                // At most 15 of the 16 vector registers (21 of AVX-512's 32): N x R accumulators, N weight vectors,
                // one activation.
                let n = match R {
                    4 if $wide => float_tiles::<4, R, BF>(bits, rows.clone(), x, r, out),
                    4..=6 => float_tiles::<2, R, BF>(bits, rows.clone(), x, r, out),
                    3 => float_tiles::<3, R, BF>(bits, rows.clone(), x, r, out),
                    _ => float_tiles::<4, R, BF>(bits, rows.clone(), x, r, out),
                };
                float_tiles::<1, R, BF>(bits, n..rows.end, x, r, out);
            }

            /// Tiles of `N` weight rows from `rows.start` while whole ones fit; returns the first row left over.
            #[inline]
            #[target_feature(enable = $features)]
            fn float_tiles<const N: usize, const R: usize, const BF: bool>(bits: &[u16], rows: Range<usize>, x: &Acts, r: usize, out: Out) -> usize {
                let mut n = rows.start;
                while n + N <= rows.end {
                    tile_float::<N, R, BF>(bits, n, x, r, out);
                    n += N;
                }
                n
            }

            /// Float weight rows `rows` times activation rows `r0..r0 + count`: six activation rows at a time on AVX2's
            /// 16 registers (tiles of 2 x 6: each widened weight vector serves six rows, and twelve independent chains
            /// of multiply-adds, where 2 x 4 tiles had eight: F16 and bf16 products mostly in 0.86-0.92 of the
            /// time), four on AVX-512's 32 (4 x 4).
            #[inline]
            #[target_feature(enable = $features)]
            fn float_panel<const BF: bool>(bits: &[u16], rows: Range<usize>, x: &Acts, r0: usize, count: usize, out: Out) {
                let step = if $wide { 4 } else { 6 };
                let full = r0 + count / step * step;
                for r in (r0..full).step_by(step) {
                    if $wide {
                        float_rows::<4, BF>(bits, rows.clone(), x, r, out);
                    } else {
                        float_rows::<6, BF>(bits, rows.clone(), x, r, out);
                    }
                }
                match r0 + count - full {
                    5 => float_rows::<5, BF>(bits, rows, x, full, out),
                    4 => float_rows::<4, BF>(bits, rows, x, full, out),
                    3 => float_rows::<3, BF>(bits, rows, x, full, out),
                    2 => float_rows::<2, BF>(bits, rows, x, full, out),
                    1 => float_rows::<1, BF>(bits, rows, x, full, out),
                    _ => {}
                }
            }

            /// Asks for panels `next`'s codes, scales and offsets a cache line at a time, before their tiles: a hint
            /// that changes no result.
            #[inline]
            #[target_feature(enable = $features)]
            fn ahead(w: &Packed, next: Range<usize>) {
                let blocks = w.k / 32;
                // `per` bytes per panel and block.
                let ask = |v: &[u8], per: usize| {
                    let (from, to) = (next.start * blocks * per, (next.end * blocks * per).min(v.len()));
                    if from < to {
                        Ahead::new(&v[from..to]).all();
                    }
                };
                let floats = |v: &[f32], per: usize| ask(bytemuck::cast_slice(v), 4 * per);
                let (codes, per) = match &w.data {
                    Data::Q4 { qs, d, m } => {
                        ask(bytemuck::cast_slice(d), 2 * PANEL);
                        ask(bytemuck::cast_slice(m), 2 * PANEL);
                        (qs, 128)
                    }
                    Data::U8 { qs, d, m } => {
                        floats(d, 2 * PANEL);
                        floats(m, 2 * PANEL);
                        (qs, 256)
                    }
                    Data::U5 { qs, d, m } => {
                        floats(d, PANEL);
                        floats(m, PANEL);
                        (qs, 160)
                    }
                    Data::S8 { qs, d, .. } => {
                        ask(bytemuck::cast_slice(d), 2 * PANEL);
                        (qs, 256)
                    }
                    Data::S5 { qs, d } => {
                        ask(bytemuck::cast_slice(d), 2 * PANEL);
                        (qs, 160)
                    }
                    Data::Q6 { qs, sc, d } | Data::Q6N { qs, sc, d } | Data::K3 { qs, sc, d } => {
                        floats(d, PANEL / 8);
                        ask(bytemuck::cast_slice(sc), 2 * PANEL);
                        (qs, super::super::signed_codes(&w.data).0)
                    }
                    Data::K4 { qs, sc, mn, d, dmin } | Data::K5 { qs, sc, mn, d, dmin } | Data::K5N { qs, sc, mn, d, dmin } => {
                        ask(bytemuck::cast_slice(d), 2 * PANEL / 8);
                        ask(bytemuck::cast_slice(dmin), 2 * PANEL / 8);
                        ask(sc, PANEL);
                        ask(mn, 8);
                        (qs, qs.len() / (w.n.div_ceil(PANEL) * blocks).max(1))
                    }
                    Data::F16(_) | Data::Bf16(_) => return,
                };
                ask(codes, per);
            }

            /// Panels `panels` times activation rows `r0..r0 + count`: tiles of four activation rows, and for the
            /// one or two rows left over, two panels at a time, so that every tile has at least two independent
            /// chains of multiply-adds and shares its activation loads. `unpacked`: [`tile`]'s.
            #[inline]
            #[target_feature(enable = $features)]
            pub(in super::super) fn quantized_panel(w: &Packed, panels: Range<usize>, x: &Acts, r0: usize, count: usize, out: Out, unpacked: (&[u8], usize)) {
                let full = r0 + count / 4 * 4;
                let mut p = panels.start;
                while p < panels.end {
                    let two = panels.end - p >= 2;
                    let step = if two { 2 } else { 1 };
                    // A decode step's few rows pass over each panel's weights once, fresh from memory: the next
                    // panels are asked for while these are computed (decode steps of 16 sequences: 5-8 % faster).
                    if x.rows() <= 16 {
                        ahead(w, p + step..(p + 2 * step).min(panels.end));
                    }
                    if $wide && two {
                        // AVX-512's 32 registers hold a 2 x 4 tile: each activation load serves two panels.
                        for r in (r0..full).step_by(4) {
                            tile::<2, 4>(w, p, x, r, out, unpacked);
                        }
                    } else {
                        for j in 0..step {
                            for r in (r0..full).step_by(4) {
                                tile::<1, 4>(w, p + j, x, r, out, unpacked);
                            }
                        }
                    }
                    match (r0 + count - full, two) {
                        (3, _) => (0..step).for_each(|j| tile::<1, 3>(w, p + j, x, full, out, unpacked)),
                        (2, true) => tile::<2, 2>(w, p, x, full, out, unpacked),
                        (2, false) => tile::<1, 2>(w, p, x, full, out, unpacked),
                        (1, true) => tile::<2, 1>(w, p, x, full, out, unpacked),
                        (1, false) => tile::<1, 1>(w, p, x, full, out, unpacked),
                        _ => {}
                    }
                    p += step;
                }
            }

            /// Weight rows `rows` (whole panels for quantized weights) times every activation row: panels of 16
            /// activation rows, whose codes stay in the L1 cache while the task's weights pass over them.
            #[target_feature(enable = $features)]
            pub(in super::super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
                let m = x.rows();
                // Weight rows a slice at a time, sized to stay in the L2 cache while every activation row passes
                // over them (a task of the output projection holds megabytes of weights).
                let slice = super::super::l2_rows(w);
                // The narrow layouts' codes (Q6N, K5N, U5, S5), past a decode step's 16 rows, laid out a byte each
                // a slice at a time, once for every row, where each tile would unpack them again. Up to 16 rows,
                // each tile unpacks its own: for Q6N, laid out two panels at a time, 5 to 16 rows took 0.99-1.17x the
                // time of `Q6`'s bytes, unpacked by the tiles 0.92-1.07x (BENCHMARKS.md, 2026-12-07, session 5).
                let (blocks, narrow) = (w.k / 32, super::super::narrow_bytes(&w.data).is_some());
                let need = if narrow && m > 16 { slice.div_ceil(PANEL) * blocks * 256 } else { 0 };
                // The thread's buffer, kept from product to product (a fresh one per product, zeroed and its pages
                // faulted in, cost U5 about 5 % of a 128-row product of SmolLM2's matrices), from a cache line's
                // start (a 32-byte load of codes each within one line).
                thread_local! {
                    static LAID_OUT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
                }
                LAID_OUT.with_borrow_mut(|buffer| {
                    if buffer.len() < need + 64 {
                        buffer.resize(need + 64, 0);
                    }
                    let skip = buffer.as_ptr().align_offset(64).min(64);
                    let unpacked = &mut buffer[skip..skip + need];
                    let mut start = rows.start;
                    while start < rows.end {
                        let part = start..(start + slice).min(rows.end);
                        let panels = part.start / PANEL..part.end.div_ceil(PANEL);
                        if !unpacked.is_empty() {
                            unpack_narrow(&w.data, blocks, panels.clone(), unpacked);
                        }
                        for r0 in (0..m).step_by(16) {
                            let count = 16.min(m - r0);
                            match &w.data {
                                Data::F16(bits) => float_panel::<false>(bits, part.clone(), x, r0, count, out),
                                Data::Bf16(bits) => float_panel::<true>(bits, part.clone(), x, r0, count, out),
                                _ => quantized_panel(w, panels.clone(), x, r0, count, out, (unpacked, panels.start)),
                            }
                        }
                        start = part.end;
                    }
                });
            }
        }
    };
}

kernels!(avx2, "avx2,fma,f16c", vnni: false, wide: false, |acc, w, x| _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))));
kernels!(avx512_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", vnni: true, wide: true, |acc, w, x| _mm256_dpbusd_epi32(acc, w, x));
kernels!(avx_vnni, "avx2,fma,f16c,avxvnni", vnni: true, wide: false, |acc, w, x| _mm256_dpbusd_avx_epi32(acc, w, x));

/// Activation quantization, for every SIMD level (VNNI adds nothing to it).
mod quantize {
    use std::arch::x86_64::*;

    /// The portable `quantize_supers`, in registers: the same bits for finite activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_supers(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16], sums16: &mut [i32]) {
        let n = d.len();
        assert!(x.len() == 256 * n && qs.len() == 256 * n && bsums.len() == 8 * n && sums16.len() == 16 * n, "activations per 256 (a bug)");
        let (lo, hi, sign) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0), _mm256_set1_ps(-0.0));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for s in 0..n {
            let xs = &x[256 * s..256 * s + 256];
            // Vector `j` of the 256, loaded where it is used: from the L1 cache, each pass. (Held in an array of 32
            // registers, twice what AVX2 has, they were copied to the stack by a call to `memcpy`, 2 % of a
            // prefill.)
            // SAFETY: `xs` holds 256 values and `j < 32`.
            let v = |j: usize| unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * j)) };
            let mut mx = _mm256_andnot_ps(sign, v(0));
            for j in 1..32 {
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v(j)));
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
            let codes = &mut qs[256 * s..256 * s + 256];
            if amax.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                // Zeros (or no finite value): the portable code's zero codes and scale.
                codes.fill(0);
                d[s] = 0.0;
                super::super::portable::store_super_sums(codes, &mut bsums[8 * s..8 * s + 8], &mut sums16[16 * s..16 * s + 16]);
                continue;
            }
            // The first value of that magnitude: its sign decides the codes' (llama.cpp's `max`).
            let target = _mm256_set1_ps(amax);
            let first = (0..32).find_map(|j| {
                let hits = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v(j)), target));
                (hits != 0).then(|| 8 * j + hits.trailing_zeros() as usize)
            });
            let iscale = -127.0 / xs[first.expect("the largest magnitude is one of the values")];
            let scale = _mm256_set1_ps(iscale);
            for q in 0..8 {
                let c: [__m256i; 4] = std::array::from_fn(|j| {
                    let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v(4 * q + j), scale));
                    _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
                });
                let lane_sum = |v: __m256i| {
                    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b00_00_00_01>(s)))
                };
                let (a, b) = (lane_sum(_mm256_add_epi32(c[0], c[1])), lane_sum(_mm256_add_epi32(c[2], c[3])));
                (sums16[16 * s + 2 * q], sums16[16 * s + 2 * q + 1]) = (a, b);
                // At most 32 x 127 in magnitude.
                bsums[8 * s + q] = (a + b) as i16;
                let packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
                // SAFETY: `codes` holds 256 codes and `32 q + 32 <= 256`.
                unsafe { _mm256_storeu_si256(codes.as_mut_ptr().add(32 * q).cast(), _mm256_permutevar8x32_epi32(packed, order)) };
            }
            d[s] = 1.0 / iscale;
        }
    }

    /// `quantize_blocks` of the portable code, in registers: the same bits for finite activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32], sums_out: &mut [i32]) {
        let blocks = d.len();
        assert!(x.len() == 32 * blocks && qs.len() == 32 * blocks && s32.len() == blocks && s16.len() == 2 * blocks && sums_out.len() == blocks, "activation blocks (a bug)");
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
            let inverse = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
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
            // `store_scales`, the four roundings to f16 precision in one instruction (the one the `half` crate uses
            // where the CPU has F16C: the same bits).
            let exact = _mm_setr_ps(scale, scale * (sums[0] + sums[1]) as f32, scale * sums[0] as f32, scale * sums[1] as f32);
            let mut kept = [0f32; 4];
            // SAFETY: `kept` holds 4 f32.
            unsafe { _mm_storeu_ps(kept.as_mut_ptr(), _mm_cvtph_ps(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(exact))) };
            (d[b], s32[b], s16[2 * b], s16[2 * b + 1], sums_out[b]) = (kept[0], kept[1], kept[2], kept[3], sums[0] + sums[1]);
        }
    }
}

/// Activations to codes per 256 at `level` (one this CPU has): `super::quantize_supers`.
pub(super) fn quantize_supers(level: super::Level, x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16], sums16: &mut [i32]) {
    match level {
        super::Level::Portable => super::portable::quantize_supers(x, qs, d, bsums, sums16),
        _ => {
            assert!(has_avx2(), "AVX2 kernels on a CPU without AVX2 (a bug)");
            // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
            unsafe { quantize::quantize_supers(x, qs, d, bsums, sums16) }
        }
    }
}

fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// Activation blocks to codes at `level` (one this CPU has).
pub(super) fn quantize_blocks(level: super::Level, x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32], sums: &mut [i32]) {
    match level {
        super::Level::Portable => super::portable::quantize_blocks(x, qs, d, s32, s16, sums),
        _ => {
            assert!(has_avx2(), "AVX2 kernels on a CPU without AVX2 (a bug)");
            // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
            unsafe { quantize::quantize_blocks(x, qs, d, s32, s16, sums) }
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

/// Whether the CPU has AVX-512 BF16's dot products, with AVX-512 F, BW and VL (the [`run_bf16_dots`] kernels).
pub(super) fn has_avx512_bf16() -> bool {
    is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl")
}

/// A bf16 matrix's weight rows `rows` times every activation row, as bf16 by bf16 ([`Acts::bf16_rows`]): the
/// `avx512-bf16` level's products of bf16 matrices.
pub(super) fn run_bf16_dots(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    assert!(has_avx2() && has_avx512_bf16(), "AVX-512 BF16 kernels on a CPU without them (a bug)");
    // SAFETY: the CPU has AVX2, FMA, F16C and AVX-512 F, BW, VL and BF16 (asserted above).
    unsafe { bf16_dots::run(w, rows, x, out) }
}

/// bf16 weights times bf16 activations on AVX-512 BF16's dot products (`vdpbf16ps`), each output's sum in f32: per
/// 32 columns, one instruction adds each of 16 lanes' two exact products (a bf16 times a bf16 fits an f32) to
/// the lane's sum, where the f32 kernels widen the weights and take 8 columns per multiply-add. Like the AMX
/// level's bf16 tiles, the instruction treats subnormal inputs as zero and flushes subnormal sums to zero. Each
/// output is its own chain of instructions over the columns in order, then one fixed reduction ([`hsum16`]),
/// whatever tile computes it: a row's result does not depend on the rows beside it.
mod bf16_dots {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::super::{l2_rows, Acts, Data, Out, Packed};

    /// Weight rows `rows` (a task's) times every activation row: a slice of weight rows sized for the L2 cache at
    /// a time, 16 activation rows at a time over it.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
        let Data::Bf16(bits) = &w.data else { unreachable!("the bf16 dot products take bf16 matrices (a bug)") };
        let (k, m, width) = (w.k, x.rows(), x.k.next_multiple_of(32));
        assert!(x.bf16_rows.len() == m * width && bits.len() >= rows.end * k, "bf16 activations or weights (a bug)");
        let slice = l2_rows(w);
        let mut start = rows.start;
        while start < rows.end {
            let part = start..(start + slice).min(rows.end);
            for r0 in (0..m).step_by(16) {
                let count = 16.min(m - r0);
                let full = r0 + count / 4 * 4;
                for r in (r0..full).step_by(4) {
                    tiles::<4>(bits, part.clone(), x, r, out);
                }
                match r0 + count - full {
                    3 => tiles::<3>(bits, part.clone(), x, full, out),
                    2 => tiles::<2>(bits, part.clone(), x, full, out),
                    1 => tiles::<1>(bits, part.clone(), x, full, out),
                    _ => {}
                }
            }
            start = part.end;
        }
    }

    /// Weight rows `rows` times activation rows `r..r + R`, in tiles of `N` weight rows by `R` activation rows:
    /// 4 x 4 (16 sums, 4 weight vectors and an activation in AVX-512's 32 registers), 8 x 1 and 8 x 2 for decode
    /// steps (more independent chains than a lone row's 4), then single rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    fn tiles<const R: usize>(bits: &[u16], rows: Range<usize>, x: &Acts, r: usize, out: Out) {
        let mut n = rows.start;
        if R <= 2 {
            while n + 8 <= rows.end {
                tile::<8, R>(bits, n, x, r, out);
                n += 8;
            }
        }
        while n + 4 <= rows.end {
            tile::<4, R>(bits, n, x, r, out);
            n += 4;
        }
        while n < rows.end {
            tile::<1, R>(bits, n, x, r, out);
            n += 1;
        }
    }

    /// Weight rows `n0..n0 + N` times activation rows `r0..r0 + R`.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    fn tile<const N: usize, const R: usize>(bits: &[u16], n0: usize, x: &Acts, r0: usize, out: Out) {
        let (k, width) = (x.k, x.k.next_multiple_of(32));
        let rows: [&[u16]; N] = std::array::from_fn(|j| &bits[(n0 + j) * k..(n0 + j + 1) * k]);
        let xs: [&[u16]; R] = std::array::from_fn(|i| &x.bf16_rows[(r0 + i) * width..(r0 + i + 1) * width]);
        let mut acc = [[_mm512_setzero_ps(); R]; N];
        let mut step = |c: usize, mask: __mmask32| {
            // SAFETY: each of `rows` holds `k` values and the load reads lane `l` only where `mask` has bit `l`:
            // all 32 from `32 c` for a whole chunk (`32 c + 32 <= k`), the `k - 32 c` left for the last (`mask`
            // below); each of `xs` holds `width` values, a multiple of 32 past `32 c`. `__m512i` and `__m512bh`
            // are both 64 bytes of vector, every bit pattern valid.
            let wv: [__m512bh; N] = std::array::from_fn(|j| unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_maskz_loadu_epi16(mask, rows[j].as_ptr().add(32 * c).cast())) });
            for i in 0..R {
                let xv = unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(xs[i].as_ptr().add(32 * c).cast())) };
                for j in 0..N {
                    acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv[j], xv);
                }
            }
        };
        for c in 0..k / 32 {
            step(c, u32::MAX);
        }
        if !k.is_multiple_of(32) {
            // The activations past `k` are zeros (`Acts::bf16_rows`), and so are the weights the mask leaves out.
            step(k / 32, (1u32 << (k % 32)) - 1);
        }
        for (j, sums) in acc.iter().enumerate() {
            for (i, &sum) in sums.iter().enumerate() {
                out.write(r0 + i, n0 + j, hsum16(sum));
            }
        }
    }

    /// The 16 lanes' sum in a fixed order: halves added, then halves of those, down to one.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    fn hsum16(v: __m512) -> f32 {
        let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let eight = _mm256_add_ps(_mm512_castps512_ps256(v), high);
        let four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps::<1>(eight));
        let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
    }
}
