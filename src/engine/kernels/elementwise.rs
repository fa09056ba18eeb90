//! Element-wise math for the CPU's layer loop: an exponential written to vectorize, and the feed-forward
//! network's `silu(gate) * up` on it.
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

/// `gate[i] = silu(gate[i]) * up[i]`, with `silu(v) = v / (1 + e^-v)`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up of different lengths (a bug)");
    const CHUNK: usize = 1 << 14;
    let level = Level::active();
    if gate.len() <= CHUNK {
        silu_mul_at(level, gate, up);
    } else {
        gate.par_chunks_mut(CHUNK).zip(up.par_chunks(CHUNK)).for_each(|(g, u)| silu_mul_at(level, g, u));
    }
}

fn silu_mul_at(level: Level, gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx2 {
        // SAFETY: `level` is at most the detected one (`Level::active`), so the CPU has AVX2, FMA and F16C.
        return unsafe { silu_mul_avx2(gate, up) };
    }
    let _ = level;
    silu_mul_body(gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up)
}

#[inline(always)]
fn silu_mul_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        silu_mul_at(Level::Portable, &mut reference, &up);
        for (i, (&y, (&g, &u))) in reference.iter().zip(gate.iter().zip(&up)).enumerate() {
            let want = g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64;
            assert!((y as f64 - want).abs() <= 1e-6 * want.abs().max(1e-30), "{i}: silu({g}) * {u} = {y}, want {want}");
        }
        for level in Level::available() {
            let mut y = gate.clone();
            silu_mul_at(level, &mut y, &up);
            assert!(y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{level:?}");
        }
    }
}
