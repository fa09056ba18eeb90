//! Element-wise math for the CPU's layer loop: an exponential written to vectorize, the gated feed-forward
//! network's `act(gate) * up` on it (SiLU for SwiGLU, tanh-approximated GELU for GeGLU), and the widening of 16-bit
//! KV cache values to f32.
//!
//! The release build targets plain x86-64 (SSE2), so loops compile 4 floats wide and `f32::exp` is a call per
//! value. These run the same source compiled for AVX2 and FMA where the CPU has them ([`super::Level`]), 8 wide;
//! the arithmetic is the same operations in the same order on every level (Rust never fuses a multiply and an add
//! on its own), so the results are bit-identical whichever runs.

use rayon::prelude::*;

use super::Level;

/// `e^x` in f32 without a library call, so that loops over it vectorize: Cody-Waite reduction by `ln 2` and a
/// degree-6 polynomial (the Cephes `expf` coefficients). Within 2 ulp of the exact value for -87.3 <= x <= 88.37;
/// 0 below (where the exact result is subnormal), `e^88.37` up to `ln(f32::MAX)` = 88.72, `+inf` above, NaN for
/// NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 x 2^23: adding it rounds a value below 2^22 to an integer, held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let clamped = x.clamp(-87.3, 88.37);
    let t = clamped * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = clamped - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let p = p * (r * r) + r + 1.0;
    // 2^n from the integer in `t`'s mantissa (`n` is within -126..=127 after the clamp).
    let scale = f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127).wrapping_shl(23));
    let y = p * scale;
    if x < -87.3 {
        0.0
    } else if x > 88.722_84 {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// The activation of a gated feed-forward network's gate: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(v) = v / (1 + e^-v)` (SwiGLU: Llama, Qwen, Mistral, Phi-3).
    Silu,
    /// GELU with its tanh approximation, `0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3)))` (GeGLU: Gemma),
    /// computed as `v / (1 + e^(-2 z))` with `z` the tanh's argument: the same function, without the cancellation
    /// of `1 + tanh(z)` where `tanh(z)` nears -1.
    GeluTanh,
}

/// `gate[i] = act(gate[i]) * up[i]`.
pub fn gated(act: Activation, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up of different lengths (a bug)");
    const CHUNK: usize = 1 << 14;
    let level = Level::active();
    if gate.len() <= CHUNK {
        gated_at(level, act, gate, up);
    } else {
        gate.par_chunks_mut(CHUNK).zip(up.par_chunks(CHUNK)).for_each(|(g, u)| gated_at(level, act, g, u));
    }
}

fn gated_at(level: Level, act: Activation, gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Vnni && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: `level` is at most the detected one (`Level::active`), so the CPU has AVX2, FMA and F16C, and it
        // has AVX-512 F (checked).
        return unsafe { gated_avx512(act, gate, up) };
    }
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx2 {
        // SAFETY: `level` is at most the detected one (`Level::active`), so the CPU has AVX2, FMA and F16C.
        return unsafe { gated_avx2(act, gate, up) };
    }
    let _ = level;
    gated_body(act, gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn gated_avx2(act: Activation, gate: &mut [f32], up: &[f32]) {
    gated_body(act, gate, up)
}

/// The same loop 16 wide, the same bits: about half the time of 8 wide on a Sapphire Rapids core (perf, a
/// prefill-heavy job: 5.8 % of it at 8 wide, 3.0 % at 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn gated_avx512(act: Activation, gate: &mut [f32], up: &[f32]) {
    gated_body(act, gate, up)
}

#[inline(always)]
fn gated_body(act: Activation, gate: &mut [f32], up: &[f32]) {
    match act {
        Activation::Silu => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + exp(-*g)) * u;
            }
        }
        Activation::GeluTanh => {
            // sqrt(2 / pi), doubled: `e^(-2 z)` with z = sqrt(2 / pi) (v + 0.044715 v^3).
            const TWO_SQRT_2_OVER_PI: f32 = 1.595_769_2;
            for (g, &u) in gate.iter_mut().zip(up) {
                let v = *g;
                let z2 = TWO_SQRT_2_OVER_PI * (v + 0.044_715 * v * v * v);
                *g = v / (1.0 + exp(-z2)) * u;
            }
        }
    }
}

/// `dst[i] = src[i]` for IEEE half-precision bits `src`: exact (every f16 is an f32), so every level gives the same
/// values; F16C's conversion where the CPU has it, `half`'s otherwise.
pub fn widen_f16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widening slices of different lengths (a bug)");
    #[cfg(target_arch = "x86_64")]
    if Level::active() >= Level::Avx2 {
        // SAFETY: the active level is at most the detected one, so the CPU has AVX2, FMA and F16C.
        return unsafe { widen_f16_f16c(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_bits(s).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_f16_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let chunks = src.len() / 8;
    for i in 0..chunks {
        // SAFETY: elements `8i..8i + 8` are within both slices (`i < len / 8`, equal lengths); the loads and stores
        // are unaligned ones.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(8 * i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(8 * i), _mm256_cvtph_ps(h));
        }
    }
    for i in 8 * chunks..src.len() {
        dst[i] = half::f16::from_bits(src[i]).to_f32();
    }
}

/// `dst[i]` = `src[i]` rounded to IEEE half precision (to nearest, ties to even; beyond the largest f16 to
/// infinity), as bits: F16C's conversion where the CPU has it, `half`'s otherwise, which round alike.
pub fn narrow_f16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "narrowing slices of different lengths (a bug)");
    #[cfg(target_arch = "x86_64")]
    if Level::active() >= Level::Avx2 {
        // SAFETY: the active level is at most the detected one, so the CPU has AVX2, FMA and F16C.
        return unsafe { narrow_f16_f16c(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(s).to_bits();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn narrow_f16_f16c(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let chunks = src.len() / 8;
    for i in 0..chunks {
        // SAFETY: elements `8i..8i + 8` are within both slices (`i < len / 8`, equal lengths); the loads and stores
        // are unaligned ones.
        unsafe {
            let h = _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm256_loadu_ps(src.as_ptr().add(8 * i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(8 * i) as *mut __m128i, h);
        }
    }
    for i in 8 * chunks..src.len() {
        dst[i] = half::f16::from_f32(src[i]).to_bits();
    }
}

/// `dst[i] = src[i]` for bfloat16 bits `src`: the bits are an f32's upper half, so exact and the same everywhere.
pub fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widening slices of different lengths (a bug)");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s as u32) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_for_every_16_bit_pattern() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut got = vec![0f32; all.len()];
        widen_f16(&all, &mut got);
        for (&bits, &y) in all.iter().zip(&got) {
            let want = half::f16::from_bits(bits).to_f32();
            assert!(y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()), "f16 {bits:#06x}: {y} against {want}");
        }
        // An odd length takes the scalar tail.
        let mut tail = vec![0f32; 13];
        widen_f16(&all[0x3c00..0x3c00 + 13], &mut tail);
        assert_eq!(tail[0], 1.0);
        assert_eq!(tail[12], half::f16::from_bits(0x3c00 + 12).to_f32());
        // Narrowing rounds to nearest even: every f16 survives the round trip, and a value halfway between two
        // rounds to the even one, as `half` does.
        let finite: Vec<f32> = got.iter().copied().filter(|v| v.is_finite()).collect();
        let mut bits = vec![0u16; finite.len()];
        narrow_f16(&finite, &mut bits);
        assert!(finite.iter().zip(&bits).all(|(&v, &b)| half::f16::from_bits(b).to_f32() == v));
        let between: Vec<f32> = (0..997).map(|i| (i as f32 - 498.0) * 0.012_345_7 + 1e-4).chain([1.0 + 1.0 / 2048.0, 70_000.0, -1e-9]).collect();
        let mut bits = vec![0u16; between.len()];
        narrow_f16(&between, &mut bits);
        for (&v, &b) in between.iter().zip(&bits) {
            assert_eq!(b, half::f16::from_f32(v).to_bits(), "{v}");
        }
        assert_eq!(half::f16::from_bits(bits[997]).to_f32(), 1.0, "a tie rounds to even");
        assert!(half::f16::from_bits(bits[998]).to_f32().is_infinite());
        widen_bf16(&all, &mut got);
        for (&bits, &y) in all.iter().zip(&got) {
            let want = half::bf16::from_bits(bits).to_f32();
            assert!(y.to_bits() == want.to_bits() || (y.is_nan() && want.is_nan()), "bf16 {bits:#06x}: {y} against {want}");
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_exact_value() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.37 {
            let exact = (x as f64).exp();
            let ulp = (exact as f32).to_bits();
            let got = exp(x);
            let err = (got as f64 - exact).abs() / (f32::from_bits(ulp + 1) as f64 - f32::from_bits(ulp) as f64);
            worst = worst.max(err);
            x += 0.001_37;
        }
        assert!(worst <= 2.0, "largest error {worst} ulp");
        assert!(worst > 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn silu_mul_matches_the_formula_and_is_the_same_on_every_level() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).chain([-200.0, 200.0, 0.0]).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut reference = gate.clone();
        gated_at(Level::Portable, Activation::Silu, &mut reference, &up);
        for (i, (&y, (&g, &u))) in reference.iter().zip(gate.iter().zip(&up)).enumerate() {
            let want = g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64;
            assert!((y as f64 - want).abs() <= 1e-6 * want.abs().max(1e-30), "{i}: silu({g}) * {u} = {y}, want {want}");
        }
        for level in Level::available() {
            let mut y = gate.clone();
            gated_at(level, Activation::Silu, &mut y, &up);
            assert!(y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{level:?}");
        }
    }

    /// GeGLU's gate: the tanh-approximated GELU as its formula defines it (within a few ulp, down to the far
    /// negative tail where `1 + tanh` would cancel), the same bits on every level.
    #[test]
    fn gelu_tanh_matches_the_formula_and_is_the_same_on_every_level() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.021).chain([-12.0, -200.0, 200.0, 0.0, 1e-6]).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 1.0 + (i % 5) as f32 * 0.5).collect();
        let mut reference = gate.clone();
        gated_at(Level::Portable, Activation::GeluTanh, &mut reference, &up);
        for (i, (&y, (&g, &u))) in reference.iter().zip(gate.iter().zip(&up)).enumerate() {
            let v = g as f64;
            let z = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
            // The definition, where `1 + tanh(z)` does not cancel in f64; the same function as `v / (1 + e^(-2z))`
            // (which the kernel computes in f32) everywhere.
            let stable = v / (1.0 + (-2.0 * z).exp()) * u as f64;
            if v > -3.0 {
                let defined = 0.5 * v * (1.0 + z.tanh()) * u as f64;
                assert!((stable - defined).abs() <= 1e-12 * defined.abs().max(1e-300), "{i}: the two forms differ at {v}");
            }
            // Relative, down to where f32 underflows (the far tail is below 1e-38).
            assert!((y as f64 - stable).abs() <= 1e-5 * stable.abs() + 1e-37, "{i}: gelu({g}) * {u} = {y}, want {stable}");
        }
        assert_eq!(reference[gate.len() - 2], 0.0, "gelu(0) is 0");
        for level in Level::available() {
            let mut y = gate.clone();
            gated_at(level, Activation::GeluTanh, &mut y, &up);
            assert!(y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{level:?}");
        }
    }
}
