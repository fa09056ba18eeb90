use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::*;

/// Every type the kernels take, with a width that is a whole number of its blocks but (for the 32-blocks) not of
/// 256: SmolLM2's 576.
const TYPES: [(GgmlDType, usize); 11] = [
    (GgmlDType::Q4_0, 576),
    (GgmlDType::Q4_1, 576),
    (GgmlDType::Q5_0, 576),
    (GgmlDType::Q5_1, 576),
    (GgmlDType::Q8_0, 576),
    (GgmlDType::Q4K, 512),
    (GgmlDType::Q5K, 768),
    (GgmlDType::Q6K, 512),
    (GgmlDType::Q3K, 768),
    (GgmlDType::F16, 200),
    (GgmlDType::BF16, 576),
];

/// A random matrix quantized by candle (ggml's quantizers): what a GGUF file of that type holds. Rows get
/// different magnitudes, and a few values are large, as in real weights.
pub(super) fn matrix(dtype: GgmlDType, n: usize, k: usize, seed: u64) -> QTensor {
    let device = Device::Cpu;
    let values: Vec<f32> = (0..n * k)
        .map(|i| {
            let h = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let u = (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let scale = 0.02 * (1 + (i / k) % 7) as f32;
            if h.is_multiple_of(97) { 8.0 * u * scale } else { u * scale }
        })
        .collect();
    let w = Tensor::from_vec(values, (n, k), &device).unwrap();
    QTensor::quantize(&w, dtype).unwrap()
}

fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    (0..m * k)
        .map(|i| {
            let h = (i as u64 + 7 * seed).wrapping_mul(0xD6E8_FEB8_6659_FD93).rotate_left(29);
            ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * if i % 53 == 0 { 12.0 } else { 2.0 }
        })
        .collect()
}

#[test]
fn packing_keeps_every_value_the_file_stores() {
    for (dtype, k) in TYPES {
        let q = matrix(dtype, 40, k, 1);
        let packed = Packed::from_qtensor(&q).unwrap().unwrap_or_else(|| panic!("{dtype:?} not packed"));
        let ours = packed.dequantize();
        let candle = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let largest = candle.iter().fold(0f32, |a, v| a.max(v.abs()));
        let exact = ours.iter().zip(&candle).filter(|(a, b)| a == b).count();
        // `d * q + m` and candle's `d * (q - c)` are the same real number; f32 may round them differently, by an
        // ulp. The per-256 types' weights are computed in ggml's order (`(d * sc) * (q - 32)`, `(d * sc) * q - dmin *
        // mn`): every one bit-identical.
        for (i, (a, b)) in ours.iter().zip(&candle).enumerate() {
            assert!((a - b).abs() <= largest * 1e-6, "{dtype:?} weight {i}: packed {a}, candle {b}");
        }
        assert!(exact * 1000 >= ours.len() * 999, "{dtype:?}: only {exact} of {} weights bit-identical", ours.len());
        if matches!(dtype, GgmlDType::Q6K | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K) {
            assert_eq!(exact, ours.len(), "{dtype:?} weights not all bit-identical");
        }
        assert_eq!((packed.rows(), packed.columns(), packed.stored_dtype()), (40, k, dtype));
    }
}

#[test]
fn the_kernels_refuse_what_they_cannot_compute_faithfully() {
    // Not a type they take.
    assert!(Packed::from_qtensor(&matrix(GgmlDType::Q2K, 4, 256, 2)).unwrap().is_none());
    // A Q8_0 code of -128 (ggml never writes it; a file could): the signed product cannot negate it.
    let mut bytes = matrix(GgmlDType::Q8_0, 2, 64, 3).data().unwrap().into_owned();
    bytes[5] = 0x80;
    assert!(pack::pack(GgmlDType::Q8_0, &bytes, 2, 64).unwrap().is_none());
    // Bytes that do not match the shape (a malformed file): an error, not a read past the end.
    assert!(pack::pack(GgmlDType::Q4_1, &bytes, 2, 64).is_err());
    assert!(pack::pack(GgmlDType::Q4_1, &[0; 80], 2, 64).is_ok());
}

/// Q6_K's products take each 256's `sum of sc * sum((q - 32) x)` over its 16 groups as an exact integer, then one
/// float step: at the extremes (codes 0 and 63, scales -128 and 127, activations of full scale, sums past 2^25)
/// every level gives the bits of that integer's float step, computed here in i64, from both of Q6_K's layouts.
#[test]
fn q6k_block_sums_are_exact_at_the_extremes() {
    let (n, k, m) = (16, 512, 35);
    let mut bytes = Vec::with_capacity(n * k / 256 * 210);
    for row in 0..n {
        for block in 0..k / 256 {
            // Rows of codes 0 (q - 32 = -32) with scale -128, codes 63 with 127, then mixed codes and scales.
            let q = |i: usize| -> u8 {
                match row % 4 {
                    0 | 2 => 0,
                    1 => 63,
                    _ => ((i * 7 + row + block) % 64) as u8,
                }
            };
            let sc = |g: usize| -> i8 {
                match row % 4 {
                    0 => -128,
                    1 => 127,
                    2 if g.is_multiple_of(2) => 127,
                    2 => -128,
                    _ => (g as i32 * 37 - 128 + row as i32) as i8,
                }
            };
            // ggml's Q6_K layout: per half of 128, low nibbles of `l` and `l + 64` in `ql[l]`, of `l + 32` and
            // `l + 96` in `ql[l + 32]`; the two-bit high parts of `l`, `l + 32`, `l + 64`, `l + 96` in `qh[l]`.
            let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
            for h in 0..2 {
                for l in 0..32 {
                    let c = |j: usize| q(128 * h + l + j);
                    ql[64 * h + l] = (c(0) & 0xF) | ((c(64) & 0xF) << 4);
                    ql[64 * h + l + 32] = (c(32) & 0xF) | ((c(96) & 0xF) << 4);
                    qh[32 * h + l] = (c(0) >> 4) | ((c(32) >> 4) << 2) | ((c(64) >> 4) << 4) | ((c(96) >> 4) << 6);
                }
            }
            bytes.extend_from_slice(&ql);
            bytes.extend_from_slice(&qh);
            bytes.extend((0..16).map(|g| sc(g) as u8));
            bytes.extend_from_slice(&half::f16::from_f32(0.001 * (1 + row) as f32).to_le_bytes());
        }
    }
    // Both layouts: a code to a byte, and the file's 6.6 bits (`Data::Q6N`).
    for narrow in [false, true] {
        let packed = pack::pack_with(GgmlDType::Q6K, &bytes, n, k, narrow).unwrap().unwrap();
        assert_eq!(matches!(packed.data, Data::Q6N { .. }), narrow);
        q6k_sums_at_the_extremes(&packed, n, k, m);
    }
}

/// `q6k_block_sums_are_exact_at_the_extremes` for one layout of its matrix.
fn q6k_sums_at_the_extremes(packed: &Packed, n: usize, k: usize, m: usize) {
    // Full-scale activations of both signs.
    let x: Vec<f32> = (0..m * k).map(|i| if (i / 16 + i / k).is_multiple_of(3) { -1.5 } else { 1.5 }).collect();
    let acts = Acts::new(Level::Portable, &x, k, Quant::Supers);
    let weights = packed.dequantize();
    let mut largest = 0i64;
    let mut want = vec![0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            let mut acc = 0f32;
            for s in 0..k / 256 {
                let (at, dw) = (c * k + 256 * s, half::f16::from_f32(0.001 * (1 + c) as f32).to_f32());
                // The weight is `dw * sc * (q - 32)` exactly (`packing_keeps_...`): `sc * (q - 32)` back from it.
                let sum: i64 = (0..256).map(|i| (weights[at + i] / dw).round() as i64 * acts.qs[r * k + 256 * s + i] as i64).sum();
                largest = largest.max(sum.abs());
                acc = (sum as f32).mul_add(dw * acts.d[r * k / 256 + s], acc);
            }
            want[r * n + c] = acc;
        }
    }
    assert!(largest > 1 << 25 && largest < 1 << 31, "the extremes reach {largest}");
    for level in Level::available() {
        let y = packed.matmul_at(level, &x, m);
        assert!(y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{level:?}: {:?} vs {:?}", &y[..4], &want[..4]);
    }
}

/// Q6_K, Q5_K, Q5_1 and Q5_0 held in the file's bits a code (`Data::Q6N`: six bits and nibbles, 6.6 bits a weight;
/// `Data::K5N`: five bits and pairs, 5.625; `Data::U5`: `K5N`'s codes and f32 scales and offsets per 32, 7.0;
/// `Data::S5`: `K5N`'s codes and the file's f16 scales, 5.5) hold the weights a code to a byte holds (`Data::Q6`,
/// `Data::K5`, `Data::U8`, `Data::S8`), in at least 1.25x fewer bytes and at most 1 % (Q5_K: 3 %, Q5_1: 17 %) more
/// than the file's, and every level gives the same bits from both: up to 16 rows (each tile unpacks its codes) and
/// more (laid out a slice at a time), a partial last panel, widths of one and of several slices of a task.
#[test]
fn the_five_and_six_bit_types_in_the_files_bytes_give_the_same_bits() {
    say_missing_levels();
    for (dtype, over) in [(GgmlDType::Q6K, 1.01), (GgmlDType::Q5K, 1.03), (GgmlDType::Q5_1, 1.17), (GgmlDType::Q5_0, 1.001)] {
        for (n, k) in [(37, 512), (70, 8192)] {
            let q = matrix(dtype, n, k, 31);
            let bytes = q.data().unwrap();
            let (wide, narrow) = (pack::pack_with(dtype, &bytes, n, k, false).unwrap().unwrap(), pack::pack_with(dtype, &bytes, n, k, true).unwrap().unwrap());
            assert!(matches!((&wide.data, &narrow.data), (Data::Q6 { .. }, Data::Q6N { .. }) | (Data::K5 { .. }, Data::K5N { .. }) | (Data::U8 { .. }, Data::U5 { .. }) | (Data::S8 { .. }, Data::S5 { .. })), "{dtype:?}");
            assert!(wide.dequantize().iter().zip(narrow.dequantize()).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} [{n}, {k}]: the layouts hold different weights");
            // The panels' padding rows count: 40 and 72 rows held for 37 and 70.
            let held = n.next_multiple_of(PANEL) as f64 / n as f64;
            assert!((narrow.bytes() as f64) <= bytes.len() as f64 * held * over, "{dtype:?} [{n}, {k}]: {} bytes for the file's {}", narrow.bytes(), bytes.len());
            assert!(wide.bytes() as f64 >= 1.25 * narrow.bytes() as f64, "{dtype:?} [{n}, {k}]: {} against {}", wide.bytes(), narrow.bytes());
            for m in [1, 3, 5, 12, 16, 17, 40] {
                let x = activations(m, k, 32 + m as u64);
                let reference = wide.matmul_at(Level::Portable, &x, m);
                for level in Level::available() {
                    for (layout, packed) in [("wide", &wide), ("narrow", &narrow)] {
                        let y = packed.matmul_at(level, &x, m);
                        assert!(y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} [{n}, {k}] m={m}: the {layout} layout at {level:?} differs from the wide one at the portable level");
                    }
                }
            }
        }
    }
}

/// Q4_K's and Q5_K's products take each 256's `sum of sc * sum(q x)` over its 8 blocks and its mins' `sum of mn *
/// sum(x)` as exact integers, then two float steps: at the extremes (codes 0 and the largest, scales and mins 0 and
/// 63, activations of full scale, sums past 2^24) every level gives the bits of those integers' float steps,
/// computed here in i64.
#[test]
fn q4k_and_q5k_sums_are_exact_at_the_extremes() {
    q4k_sums_at_the_extremes(false);
    q4k_sums_at_the_extremes(true);
}

fn q4k_sums_at_the_extremes(five: bool) {
    let (n, k, m) = (16, 512, 35);
    let top = if five { 31 } else { 15 };
    let code = |row: usize, i: usize| -> u8 {
        match row % 4 {
            0 => top,
            1 => 0,
            2 => if (i / 7).is_multiple_of(2) { top } else { 0 },
            _ => ((i * 5 + row) % (top as usize + 1)) as u8,
        }
    };
    let scale = |row: usize, j: usize| -> (u8, u8) {
        match row % 4 {
            0 | 2 => (63, 63),
            1 => (0, 63),
            _ => (((j * 11 + row) % 64) as u8, ((j * 29 + 3 * row) % 64) as u8),
        }
    };
    let d = |row: usize| half::f16::from_f32(0.0005 * (1 + row) as f32);
    let dmin = |row: usize| half::f16::from_f32(0.0007 * (2 + row) as f32);
    let mut bytes = Vec::with_capacity(n * k / 256 * 176);
    for row in 0..n {
        for sb in 0..k / 256 {
            let (dr, mr) = (d(row), dmin(row));
            bytes.extend_from_slice(&dr.to_le_bytes());
            bytes.extend_from_slice(&mr.to_le_bytes());
            // ggml's 12 bytes of 6-bit scales and mins (`get_scale_min_k4` reads them back).
            let (sc, mn): (Vec<u8>, Vec<u8>) = (0..8).map(|j| scale(row, j)).unzip();
            let mut packed = [0u8; 12];
            for j in 0..4 {
                packed[j] = sc[j] | (sc[j + 4] >> 4) << 6;
                packed[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
                packed[j + 8] = (sc[j + 4] & 0xF) | (mn[j + 4] & 0xF) << 4;
            }
            bytes.extend_from_slice(&packed);
            // Q5_K: the fifth bits first, weight `64 c + l`'s in bit `2c` of byte `l`, `64 c + 32 + l`'s in bit `2c + 1`.
            let at = |c: usize, l: usize| code(row, 256 * sb + 64 * c + l);
            if five {
                bytes.extend((0..32).map(|l| (0..4).map(|c| (at(c, l) >> 4) << (2 * c) | (at(c, 32 + l) >> 4) << (2 * c + 1)).sum::<u8>()));
            }
            // Per 64: low nibbles the first 32 weights, high nibbles the next 32.
            for c in 0..4 {
                bytes.extend((0..32).map(|l| (at(c, l) & 0xF) | (at(c, 32 + l) & 0xF) << 4));
            }
        }
    }
    let dtype = if five { GgmlDType::Q5K } else { GgmlDType::Q4K };
    // Q5_K in both its layouts, a code to a byte (`K5`) and the file's five bits (`K5N`).
    let layouts: Vec<Packed> = [false, true].into_iter().take(if five { 2 } else { 1 }).map(|narrow| pack::pack_with(dtype, &bytes, n, k, narrow).unwrap().unwrap()).collect();
    let candle = candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &bytes, vec![n, k], &Device::Cpu).unwrap();
    for packed in &layouts {
        assert_eq!(packed.dequantize(), candle.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(), "{dtype:?} weights as ggml decodes them");
    }
    let x: Vec<f32> = (0..m * k).map(|i| if (i / 32 + i / k) % 7 == 0 { -1.5 } else { 1.5 }).collect();
    let acts = Acts::new(Level::Portable, &x, k, Quant::Supers);
    let mut largest = 0i64;
    let mut want = vec![0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            let mut acc = 0f32;
            for s in 0..k / 256 {
                let xq = |i: usize| acts.qs[r * k + 256 * s + i] as i64;
                let sum: i64 = (0..256).map(|i| scale(c, i / 32).0 as i64 * code(c, 256 * s + i) as i64 * xq(i)).sum();
                let msum: i64 = (0..256).map(|i| scale(c, i / 32).1 as i64 * xq(i)).sum();
                largest = largest.max(sum.abs());
                let xd = acts.d[r * k / 256 + s];
                acc = (sum as f32).mul_add(d(c).to_f32() * xd, acc);
                acc = (msum as f32).mul_add(-dmin(c).to_f32() * xd, acc);
            }
            want[r * n + c] = acc;
        }
    }
    assert!(largest > if five { 1 << 25 } else { 1 << 24 } && largest < 1 << 31, "{dtype:?}: the extremes reach {largest}");
    for packed in &layouts {
        for level in Level::available() {
            let y = packed.matmul_at(level, &x, m);
            assert!(y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} {level:?}: {:?} vs {:?}", &y[..4], &want[..4]);
        }
    }
}

/// Whether a level computes a type's products with the portable kernels' bits: every level every type, but the AMX
/// and AVX-512 BF16 levels' bf16 products, which round the activations to bf16 (`amx_bf16_tiles_...`,
/// `avx512_bf16_dots_...`), and the AMX level's F16 products of 16 rows or more, which split weights and
/// activations into bf16 parts (`amx_f16_tiles_...`).
fn same_bits(level: Level, dtype: GgmlDType) -> bool {
    !(level == Level::Amx && matches!(dtype, GgmlDType::BF16 | GgmlDType::F16) || level == Level::Avx512Bf16 && dtype == GgmlDType::BF16)
}

/// Every finite F16 weight is exactly the sum of its two bf16 parts, in AVX-512 as one by one; an infinite one's
/// low part is zero (not `inf - inf`).
#[cfg(target_arch = "x86_64")]
#[test]
fn f16_weights_split_exactly_into_two_bf16_parts() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let (mut hi, mut lo) = (vec![0u16; all.len()], vec![0u16; all.len()]);
    let avx512 = is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
    if avx512 {
        // SAFETY: the CPU has AVX-512 F and BW (checked above).
        unsafe { amx::split_f16(&all[..65_535], &mut hi[..65_535], &mut lo[..65_535]) };
        (hi[65_535], lo[65_535]) = amx::split_f16_one(65_535);
    } else {
        eprintln!("no AVX-512 here: the F16 split is checked one by one only");
    }
    for &bits in &all {
        let (h, l) = amx::split_f16_one(bits);
        let w = half::f16::from_bits(bits).to_f32();
        let (hf, lf) = (half::bf16::from_bits(h).to_f32(), half::bf16::from_bits(l).to_f32());
        if w.is_finite() {
            assert_eq!(hf + lf, w, "{bits:#06x}: {hf} + {lf}");
            assert!(lf.abs() <= w.abs() / 128.0, "{bits:#06x}: low part {lf} of {w}");
        } else if w.is_infinite() {
            assert_eq!((hf, lf), (w, 0.0), "{bits:#06x}");
        } else {
            assert!(hf.is_nan() || hf.is_infinite(), "{bits:#06x}");
        }
        if avx512 {
            assert_eq!((hi[bits as usize], lo[bits as usize]), (h, l), "{bits:#06x}: AVX-512 and one by one differ");
        }
    }
}

/// The activations' split for the F16 tiles: in AVX-512 the same bits as one by one, over ordinary values, ties,
/// subnormals, the largest finite values (whose high part rounds to infinity), infinities and NaNs; `hi + lo`
/// within 2^-16 of each finite value whose high part is finite.
#[cfg(target_arch = "x86_64")]
#[test]
fn activations_split_into_two_bf16_parts_alike_in_avx512() {
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
        eprintln!("no AVX-512 here: the activations' AVX-512 split is not checked");
        return;
    }
    let mut values = activations(9, 200, 5);
    let specials = [0.0, -0.0, 1.0, f32::from_bits(0x3F80_8000), f32::from_bits(0x3F81_8000), f32::from_bits(0x3F80_8001), 1e-40, -3e-39, f32::MAX, -f32::MAX, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::from_bits(0x7F80_0001), 65504.0, 1e-30];
    values.extend(specials);
    values.extend((0..1000u32).map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B9))));
    let (mut hi, mut lo) = (vec![0u16; values.len()], vec![0u16; values.len()]);
    // SAFETY: the CPU has AVX-512 F and BW (checked above).
    unsafe { amx::split_acts(&values, &mut hi, &mut lo) };
    for (i, &v) in values.iter().enumerate() {
        assert_eq!((hi[i], lo[i]), split_bf16(v), "{v:e} ({:#010x})", v.to_bits());
        let (h, l) = (half::bf16::from_bits(hi[i]).to_f64(), half::bf16::from_bits(lo[i]).to_f64());
        if v.is_finite() && h.is_finite() {
            assert!((h + l - v as f64).abs() <= (v as f64).abs() / 65536.0 + 1e-39, "{v:e}: {h} + {l}");
        }
    }
}

/// The AMX level's F16 products of at least `F16_TILE_ROWS` rows: three bf16 tile products of the weights' exact
/// parts and the activations' two parts. Against an f64 sum of the exact products (f32 activations times the stored
/// weights), within 5e-5 of the products' magnitude (the split's 2^-15 + 2^-16 at worst, and f32 accumulation),
/// where activations rounded to bf16 are up to 2^-8 off; most outputs at least 16 times closer than those rounded
/// activations' (the low
/// parts are there); at every shape the tiles take, with rows' results independent of their neighbours in tiles;
/// below `F16_TILE_ROWS` rows, the portable kernels' bits.
#[test]
fn amx_f16_tiles_compute_the_stored_weights_to_16_bits_of_the_activations() {
    #[cfg(target_arch = "x86_64")]
    if !amx::bf16_granted() {
        eprintln!("this CPU (or Linux) gives no AMX-BF16 tiles: the F16 tile test is skipped here");
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    return;
    for (n, k) in [(64, 576), (30, 200), (100, 72), (16, 1536)] {
        let q = matrix(GgmlDType::F16, n, k, 31);
        let packed = Packed::from_qtensor(&q).unwrap().unwrap();
        let w = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for m in [5, 16, 23, 24, 35, 50, 275] {
            let x = activations(m, k, 32 + m as u64);
            let y = packed.matmul_at(Level::Amx, &x, m);
            let portable = packed.matmul_at(Level::Portable, &x, m);
            if m < F16_TILE_ROWS {
                assert!(y.iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits()), "n={n} k={k} m={m}: not the exact products");
                continue;
            }
            let mut closer = 0;
            for r in 0..m {
                for c in 0..n {
                    let (mut sum, mut rounded, mut magnitude) = (0f64, 0f64, 0f64);
                    for i in 0..k {
                        let (wi, xi) = (w[c * k + i] as f64, x[r * k + i]);
                        sum += wi * xi as f64;
                        rounded += wi * half::bf16::from_f32(xi).to_f64();
                        magnitude += (wi * xi as f64).abs();
                    }
                    let (got, at) = (y[r * n + c] as f64, r * n + c);
                    assert!((got - sum).abs() <= 5e-5 * magnitude + 1e-6, "n={n} k={k} m={m} output {at}: {got} vs {sum}");
                    closer += usize::from((got - sum).abs() * 16.0 <= (rounded - sum).abs());
                }
            }
            assert!(closer * 4 > m * n * 3, "n={n} k={k} m={m}: only {closer} outputs beat bf16-rounded activations by 16x (are the low parts used?)");
            if m >= 48 {
                let alone = packed.matmul_at(Level::Amx, &x[16 * k..48 * k], 32);
                let rows = &y[16 * n..48 * n];
                assert!(alone.iter().zip(rows).all(|(a, b)| a.to_bits() == b.to_bits()), "n={n} k={k} m={m}: rows 16..48 alone");
            }
        }
    }
}

/// The AMX level's bf16 products: the activations rounded to bf16 (to nearest, ties to even), each output's sum
/// of exact products in f32 ([`bf16_products_round_the_activations`]), at every shape the tiles take (a last tile
/// of fewer than 16 rows, weight rows that do not fill a tile, widths not a multiple of 32) and below
/// `BF16_TILE_ROWS` (the VNNI kernels on the same rounded activations). A row's result does not depend on which
/// other rows share its product, as long as it runs in tiles.
#[test]
fn amx_bf16_tiles_compute_the_rounded_activations_times_the_stored_weights() {
    #[cfg(target_arch = "x86_64")]
    if !amx::bf16_granted() {
        eprintln!("this CPU (or Linux) gives no AMX-BF16 tiles: the bf16 tile test is skipped here");
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    return;
    bf16_products_round_the_activations(Level::Amx, BF16_TILE_ROWS);
}

/// The AVX-512 BF16 level's bf16 products (`vdpbf16ps`), as the AMX level's ([`bf16_products_round_the_activations`]),
/// at widths with a last part of 8, 16 and 24 columns (the masked loads) and tiles of 8, 4 and 1 weight rows by
/// 1 to 4 activation rows; a row's result does not depend on which other rows share its product.
#[test]
fn avx512_bf16_dots_compute_the_rounded_activations_times_the_stored_weights() {
    if !Level::available().contains(&Level::Avx512Bf16) {
        eprintln!("this CPU has no AVX-512 BF16: the avx512-bf16 level's test is skipped here");
        return;
    }
    bf16_products_round_the_activations(Level::Avx512Bf16, 1);
}

/// `level`'s products of bf16 matrices against an f64 sum of the activations rounded to bf16 times the stored
/// weights, within f32 accumulation (a relative 1e-5 of the products' magnitude); against the portable kernels
/// (activations in f32), within the rounding's bound (2^-8, bf16's unit roundoff, of each product's magnitude)
/// and not equal. Rows from 16 computed alone (at least `alone` of them) give the same bits.
fn bf16_products_round_the_activations(level: Level, alone: usize) {
    for (n, k) in [(64, 576), (30, 200), (100, 72), (16, 1536), (13, 40), (21, 56)] {
        let q = matrix(GgmlDType::BF16, n, k, 21);
        let packed = Packed::from_qtensor(&q).unwrap().unwrap();
        let w = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for m in [1, 5, 8, 16, 35, 50, 275] {
            let x = activations(m, k, 22 + m as u64);
            let y = packed.matmul_at(level, &x, m);
            let portable = packed.matmul_at(Level::Portable, &x, m);
            let rounded: Vec<f64> = x.iter().map(|&v| half::bf16::from_f32(v).to_f64()).collect();
            let mut differs = 0;
            for r in 0..m {
                for c in 0..n {
                    let (mut sum, mut magnitude, mut exact_magnitude) = (0f64, 0f64, 0f64);
                    for i in 0..k {
                        let product = w[c * k + i] as f64 * rounded[r * k + i];
                        sum += product;
                        magnitude += product.abs();
                        exact_magnitude += (w[c * k + i] as f64 * x[r * k + i] as f64).abs();
                    }
                    let (got, at) = (y[r * n + c] as f64, r * n + c);
                    assert!((got - sum).abs() <= 1e-5 * magnitude + 1e-6, "n={n} k={k} m={m} output {at}: {got} vs {sum}");
                    let rounding = exact_magnitude / 256.0 + 1e-5 * exact_magnitude + 1e-6;
                    assert!((got - portable[at] as f64).abs() <= rounding, "n={n} k={k} m={m} output {at}: {got} vs portable {}", portable[at]);
                    differs += usize::from(y[at].to_bits() != portable[at].to_bits());
                }
            }
            assert!(differs * 4 > m * n, "n={n} k={k} m={m}: only {differs} outputs differ from f32 activations' (is the rounding done?)");
            for count in [alone, alone.max(3)] {
                if m >= 16 + count {
                    let by_themselves = packed.matmul_at(level, &x[16 * k..(16 + count) * k], count);
                    let rows = &y[16 * n..(16 + count) * n];
                    assert!(by_themselves.iter().zip(rows).all(|(a, b)| a.to_bits() == b.to_bits()), "n={n} k={k} m={m}: rows 16..{} alone", 16 + count);
                }
            }
        }
    }
}

#[test]
#[allow(clippy::excessive_precision)] // 1.00390625 is written out exactly: halfway between two bf16 values
fn bf16_rounding_is_to_nearest_even() {
    for v in [0.0f32, -0.0, 1.0, 1.00390625, 1.0117188, -std::f32::consts::PI, 65504.0, 1e-40, f32::MAX, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE] {
        assert_eq!(round_bf16(v), half::bf16::from_f32(v).to_bits(), "{v}");
    }
    // Exactly halfway: ties go to the even neighbour.
    assert_eq!(round_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
    assert_eq!(round_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
    for i in 0..100_000u32 {
        let v = f32::from_bits(i.wrapping_mul(0x9E37_79B9));
        if !v.is_nan() {
            assert_eq!(round_bf16(v), half::bf16::from_f32(v).to_bits(), "{v:e}");
        }
    }
    assert!(half::bf16::from_bits(round_bf16(f32::NAN)).is_nan());
}

/// The levels this machine lacks, said once per test run (a test that cannot check a level says so).
fn say_missing_levels() {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        let missing: Vec<&str> = [Level::Avx2, Level::Vnni, Level::Avx512Bf16, Level::Amx].into_iter().filter(|l| !Level::available().contains(l)).map(|l| l.name()).collect();
        if !missing.is_empty() {
            eprintln!("this CPU lacks the kernel levels {missing:?}: their bit-for-bit checks are skipped here");
        }
    });
}

/// Q5_0's signed codes (-16..=15) take AVX2's short path, four groups' products added in 16 bits, in both its layouts
/// (`S8`, and `S5`'s five bits a code): at the extremes (every code 15 or every code -16, full-scale activations of
/// one sign per block, the 16-bit sums at their largest, 31,496) every level gives the portable kernels' bits. A
/// Q8_0 matrix, whose codes reach 127, does not take that path.
#[test]
fn small_signed_codes_sum_exactly_in_16_bits_at_the_extremes() {
    say_missing_levels();
    let (n, k, m) = (24, 128, 6);
    let mut bytes = Vec::with_capacity(n * k / 32 * 22);
    for row in 0..n {
        for block in 0..k / 32 {
            // Codes q (code = q - 16): all 31, all 0, or mixed.
            let q = |j: usize| -> u8 {
                match row % 3 {
                    0 => 31,
                    1 => 0,
                    _ => ((j * 5 + row + block) % 32) as u8,
                }
            };
            bytes.extend_from_slice(&half::f16::from_f32(0.01 * (1 + row) as f32).to_le_bytes());
            let qh: u32 = (0..32).map(|j| ((q(j) >> 4) as u32) << j).sum();
            bytes.extend_from_slice(&qh.to_le_bytes());
            bytes.extend((0..16).map(|j| (q(j) & 0xF) | ((q(j + 16) & 0xF) << 4)));
        }
    }
    let packed = pack::pack_with(GgmlDType::Q5_0, &bytes, n, k, false).unwrap().unwrap();
    assert!(matches!(packed.data, Data::S8 { small: true, .. }));
    let narrow = pack::pack_with(GgmlDType::Q5_0, &bytes, n, k, true).unwrap().unwrap();
    assert!(matches!(narrow.data, Data::S5 { .. }));
    let q8 = Packed::from_qtensor(&matrix(GgmlDType::Q8_0, 8, 64, 5)).unwrap().unwrap();
    assert!(matches!(q8.data, Data::S8 { small: false, .. }));
    // Activation codes of +-127, one sign per block and row.
    let x: Vec<f32> = (0..m * k).map(|i| if (i / 32 + i / k) % 2 == 0 { 1.5 } else { -1.5 }).collect();
    let acts = Acts::new(Level::Portable, &x, k, Quant::Blocks);
    assert!(acts.qs.iter().all(|&c| c == 127 || c == -127));
    let reference = packed.matmul_at(Level::Portable, &x, m);
    let weights = packed.dequantize();
    // The portable kernels' sums, checked against i64 ones for row 0 (codes 15 times 127: 32 x 1,905 per block).
    for c in 0..n {
        let mut acc = 0f32;
        for b in 0..k / 32 {
            let dw = half::f16::from_f32(0.01 * (1 + c) as f32).to_f32();
            let sum: i64 = (0..32).map(|i| (weights[c * k + 32 * b + i] / dw).round() as i64 * acts.qs[32 * b + i] as i64).sum();
            acc = (sum as f32).mul_add(dw * acts.d[b], acc);
        }
        assert_eq!(acc.to_bits(), reference[c].to_bits(), "row {c}");
    }
    for level in Level::available() {
        for (layout, packed) in [("S8", &packed), ("S5", &narrow)] {
            let y = packed.matmul_at(level, &x, m);
            assert!(y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{layout} at {level:?} differs from the portable kernels");
        }
    }
}

#[test]
fn every_level_gives_the_same_bits_at_any_row_count() {
    say_missing_levels();
    for (dtype, k) in TYPES {
        let packed = Packed::from_qtensor(&matrix(dtype, 37, k, 4)).unwrap().unwrap();
        // Past 16 rows, whole tiles of 16 for the AMX level and the rows left over for the VNNI kernels; past 256,
        // several groups of tiles. AVX2's float tiles take 6 rows at a time, then the 1 to 5 left over.
        for m in [1, 2, 3, 4, 5, 6, 9, 11, 16, 22, 48, 275] {
            let x = activations(m, k, m as u64);
            let reference = packed.matmul_at(Level::Portable, &x, m);
            for level in Level::available().into_iter().filter(|&l| same_bits(l, dtype)) {
                let y = packed.matmul_at(level, &x, m);
                let same = y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?} m={m}: {level:?} differs from the portable kernels");
            }
            // A row's result does not depend on the rows beside it.
            let alone = packed.matmul_at(Level::active(), &x[(m - 1) * k..], 1);
            assert!(alone.iter().zip(&reference[(m - 1) * 37..]).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} m={m}");
        }
    }
}

/// Weight rows in whole pairs of panels, a pair whose second panel is partly padding (30 rows), a panel left alone
/// (40 rows), and tasks of several pairs (the widest): the tile unit's shapes and the VNNI kernels' share of them
/// give the portable kernels' bits.
#[test]
fn tiles_of_every_shape_give_the_same_bits() {
    say_missing_levels();
    // Tasks take at least 16 weight rows, more where a matrix has more than 128 per thread: the widest here gives
    // tasks of 48 rows (2 x 2 tile products and 2 x 1) and a last one of 24 (a pair and a panel left alone).
    let wide = 256 * rayon::current_num_threads() + 40;
    for (dtype, k) in TYPES {
        for n in [30, 40, 64, wide] {
            let packed = Packed::from_qtensor(&matrix(dtype, n, k, 12)).unwrap().unwrap();
            let m = 35;
            let x = activations(m, k, 13);
            let reference = packed.matmul_at(Level::Portable, &x, m);
            for level in Level::available().into_iter().filter(|&l| same_bits(l, dtype)) {
                let y = packed.matmul_at(level, &x, m);
                assert!(y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} n={n}: {level:?} differs from the portable kernels");
            }
        }
    }
}

/// A wide matrix (k = 8,192, a feed-forward down projection's) takes the tile kernels' smaller groups of rows
/// (`amx::GROUP_BYTES`): past 128 rows several groups, and the portable kernels' bits. With 16 weight rows, one
/// pair of panels serves every group (laid out once); with more, each group goes through several pairs, each laid
/// out while the one before computes.
#[test]
fn wide_matrices_give_the_same_bits_in_smaller_groups_of_rows() {
    say_missing_levels();
    let k = 8192;
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        for n in [16, 32, 72] {
            let packed = Packed::from_qtensor(&matrix(dtype, n, k, 21)).unwrap().unwrap();
            let m = 290;
            let x = activations(m, k, 22);
            let reference = packed.matmul_at(Level::Portable, &x, m);
            for level in Level::available().into_iter().filter(|&l| same_bits(l, dtype)) {
                let y = packed.matmul_at(level, &x, m);
                assert!(y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?} n={n}: {level:?} differs from the portable kernels");
            }
        }
    }
}

/// `x · Wᵀ` with candle's dequantized weights, in f64, and for each output the most the activations' 8-bit
/// rounding can move it: half a code step of each block of 32 (of 256 for the k-quants) times the weights'
/// absolute sum there (for quantized weights; F16 and BF16 take the activations in f32).
fn reference(q: &QTensor, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = q.shape().dims2().unwrap();
    let w = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let quantized = !matches!(q.dtype(), GgmlDType::F16 | GgmlDType::BF16);
    // The k-quants take activations quantized per 256.
    let block = if matches!(q.dtype(), GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K) { 256 } else { 32 };
    let (mut y, mut bound) = (vec![0f64; m * n], vec![0f64; m * n]);
    for r in 0..m {
        let xr = &x[r * k..(r + 1) * k];
        for c in 0..n {
            let wr = &w[c * k..(c + 1) * k];
            let (mut sum, mut magnitude, mut rounding) = (0f64, 0f64, 0f64);
            for (xb, wb) in xr.chunks(block).zip(wr.chunks(block)) {
                let step = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                for (a, v) in wb.iter().zip(xb) {
                    sum += *a as f64 * *v as f64;
                    magnitude += (*a as f64 * *v as f64).abs();
                    if quantized {
                        rounding += (*a as f64).abs() * step / 2.0;
                    }
                }
            }
            y[r * n + c] = sum;
            // f32 accumulation: a relative 1e-5 of the products' magnitude, far above its rounding.
            bound[r * n + c] = rounding + 1e-5 * magnitude + 1e-6;
        }
    }
    (y, bound)
}

#[test]
fn products_match_candle_dequantize_then_matmul_within_the_activations_rounding() {
    for (dtype, k) in TYPES {
        let q = matrix(dtype, 33, k, 5);
        let packed = Packed::from_qtensor(&q).unwrap().unwrap();
        for m in [1, 6] {
            let x = activations(m, k, 11);
            let y = packed.matmul(&x, m);
            let (want, bound) = reference(&q, &x, m);
            let mut worst = 0f64;
            for i in 0..y.len() {
                let err = (y[i] as f64 - want[i]).abs();
                assert!(err <= bound[i], "{dtype:?} m={m} output {i}: {} vs {} (bound {})", y[i], want[i], bound[i]);
                worst = worst.max(err / bound[i]);
            }
            // The bound is not vacuous: quantized products use a good part of it.
            if !matches!(dtype, GgmlDType::F16 | GgmlDType::BF16) {
                assert!(worst > 0.01, "{dtype:?}: largest error only {worst} of the bound");
            }
        }
    }
}

#[test]
fn several_matrices_share_one_quantization_and_one_parallel_region() {
    let (a, b) = (matrix(GgmlDType::Q4_1, 70, 576, 6), matrix(GgmlDType::Q8_0, 500, 576, 7));
    let (pa, pb) = (Packed::from_qtensor(&a).unwrap().unwrap(), Packed::from_qtensor(&b).unwrap().unwrap());
    let x = activations(3, 576, 8);
    let both = matmul_many(Level::active(), &[&pa, &pb], &x, 3);
    assert_eq!(both[0], pa.matmul(&x, 3));
    assert_eq!(both[1], pb.matmul(&x, 3));
    assert_eq!(both[1].len(), 3 * 500);
}

/// A bf16 and an F16 matrix in one product (a file may mix them): at every level each gives what it gives alone, so
/// at the AVX-512 BF16 and AMX levels the bf16 one on rounded activations and the F16 one on its own terms.
#[test]
fn bf16_and_f16_matrices_in_one_product_each_give_their_own_results() {
    let (a, b) = (matrix(GgmlDType::BF16, 40, 72, 31), matrix(GgmlDType::F16, 24, 72, 32));
    let (pa, pb) = (Packed::from_qtensor(&a).unwrap().unwrap(), Packed::from_qtensor(&b).unwrap().unwrap());
    for level in Level::available() {
        for m in [1, 5] {
            let x = activations(m, 72, 33);
            let both = matmul_grouped(level, &[&pa, &pb], &x, m);
            assert_eq!(both[0], pa.matmul_at(level, &x, m), "{level:?} m={m}: the bf16 matrix");
            assert_eq!(both[1], pb.matmul_at(level, &x, m), "{level:?} m={m}: the F16 matrix");
        }
    }
}

#[test]
fn the_level_variable_names_a_level() {
    assert_eq!(Level::parse("avx2"), Some(Level::Avx2));
    assert_eq!(Level::parse("portable"), Some(Level::Portable));
    assert_eq!(Level::parse("vnni"), Some(Level::Vnni));
    assert_eq!(Level::parse("amx"), Some(Level::Amx));
    assert_eq!(Level::parse("avx512-bf16"), Some(Level::Avx512Bf16));
    assert_eq!(Level::parse("avx512"), None);
    assert!(Level::available().contains(&Level::Portable));
    assert!(Level::active() <= Level::detected());
    assert!(Level::preferred() <= Level::Vnni, "AMX is taken only when asked for");
    // Where the CPU lists AMX, the level exists: the CPUID bits are read right and Linux granted the tiles
    // (`arch_prctl`, Linux 5.16 and later).
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let listed = cpuinfo.lines().any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "amx_int8") && l.split_whitespace().any(|f| f == "avx512_vnni"));
    assert_eq!(Level::available().contains(&Level::Amx), listed, "/proc/cpuinfo lists amx_int8: {listed}");
    // And AVX-512 BF16's level wherever the CPU lists its flags (every CPU with AMX does).
    let has = |flag: &str| cpuinfo.lines().any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == flag));
    let bf16 = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"].into_iter().all(has);
    assert_eq!(Level::available().contains(&Level::Avx512Bf16), bf16 || listed, "/proc/cpuinfo lists avx512_bf16: {bf16}");
    // `runtime.cpu_kernels`: a level the CPU has is taken, one it lacks gives the default, `auto` the default.
    // (Other tests may run meanwhile: the portable level computes the same bits as the default; the AMX level's
    // bf16 products do not, so it is resolved here, never settled.)
    use crate::job::CpuKernels;
    assert_eq!(Level::choose(CpuKernels::Portable), Level::Portable);
    assert_eq!(Level::active(), Level::Portable);
    assert_eq!(Level::resolve(CpuKernels::Amx), if listed { Level::Amx } else { Level::preferred() });
    assert_eq!(Level::resolve(CpuKernels::Avx512Bf16), if bf16 || listed { Level::Avx512Bf16 } else { Level::preferred() });
    assert_eq!(Level::choose(CpuKernels::Auto), Level::preferred());
    assert_eq!(Level::active(), Level::preferred());
}

#[test]
fn activation_codes_are_the_same_at_every_level() {
    let x = activations(5, 576, 9);
    let reference = Acts::new(Level::Portable, &x, 576, Quant::Blocks);
    for level in Level::available() {
        let a = Acts::new(level, &x, 576, Quant::Blocks);
        assert_eq!(a.qs, reference.qs, "{level:?}");
        assert_eq!(a.sums, reference.sums, "{level:?}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&a.d), bits(&a.s32), bits(&a.s16)), (bits(&reference.d), bits(&reference.s32), bits(&reference.s16)), "{level:?}");
    }
    let exact: Vec<i32> = reference.qs.chunks_exact(32).map(|c| c.iter().map(|&q| q as i32).sum()).collect();
    assert_eq!(reference.sums, exact);
    // Codes span -127..=127: the largest value of each block maps to +-127.
    assert!(reference.qs.iter().any(|&q| q == 127 || q == -127));
    assert!(reference.qs.iter().all(|&q| q != i8::MIN));
}

/// The k-quants' activations per 256 are llama.cpp's `Q8_K` (`quantize_row_q8_K_ref`): the first value of largest
/// magnitude `max` maps to -127, every code is `min(127, round(x * -127 / max))` (ties to even) with scale
/// `1 / (-127 / max)`, and the sums per 32 and 16 are exact; the same at every level.
#[test]
fn activation_codes_per_256_are_llama_cpps_q8_k() {
    let (m, k) = (5, 768);
    let mut x = activations(m, k, 9);
    // A 256 of zeros, and one whose largest magnitude comes twice, with both signs (the first one counts).
    x[256..512].fill(0.0);
    x[600] = -30.0;
    x[700] = 30.0;
    let reference = Acts::new(Level::Portable, &x, k, Quant::Supers);
    for level in Level::available() {
        let a = Acts::new(level, &x, k, Quant::Supers);
        assert_eq!((&a.qs, &a.bsums, &a.sums16), (&reference.qs, &reference.bsums, &reference.sums16), "{level:?}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.d), bits(&reference.d), "{level:?}");
    }
    for (s, (xs, qs)) in x.chunks_exact(256).zip(reference.qs.chunks_exact(256)).enumerate() {
        let first = (0..256).fold(0, |best, i| if xs[i].abs() > xs[best].abs() { i } else { best });
        let max = xs[first];
        if max == 0.0 {
            assert!(qs.iter().all(|&q| q == 0) && reference.d[s] == 0.0);
            continue;
        }
        let iscale = -127.0 / max;
        assert_eq!(qs[first], -127, "256 {s}");
        assert_eq!(reference.d[s].to_bits(), (1.0 / iscale).to_bits());
        for (v, &q) in xs.iter().zip(qs) {
            assert_eq!(q as f32, (v * iscale).round_ties_even().min(127.0), "256 {s}: {v}");
        }
    }
    assert_eq!(x[600..700].iter().fold(0f32, |a, v| a.max(v.abs())), 30.0);
    assert_eq!(reference.qs[600], -127, "the first of two equal magnitudes is the one that maps to -127");
    assert_eq!(reference.qs[700], 127);
    let per = |n: usize| -> Vec<i32> { reference.qs.chunks_exact(n).map(|c| c.iter().map(|&q| q as i32).sum()).collect() };
    assert_eq!(reference.sums16, per(16));
    assert_eq!(reference.bsums.iter().map(|&b| b as i32).collect::<Vec<_>>(), per(32));
}

/// A task whose weights are larger than its L2 slice (`l2_rows`) runs them a slice at a time: every row is
/// computed once, the same bits as the portable kernels (which do not slice), the last panel's padding included.
#[test]
fn a_task_larger_than_its_cache_slice_computes_every_row_once() {
    for (dtype, k) in [(GgmlDType::Q8_0, 576), (GgmlDType::Q4_1, 576), (GgmlDType::F16, 2048)] {
        let probe = Packed::from_qtensor(&matrix(dtype, 16, k, 9)).unwrap().unwrap();
        let n = 2 * l2_rows(&probe) + 12;
        let packed = Packed::from_qtensor(&matrix(dtype, n, k, 9)).unwrap().unwrap();
        assert!(l2_rows(&packed) < n && l2_rows(&packed).is_multiple_of(16), "{dtype:?}: slices of {} rows", l2_rows(&packed));
        let m = 19;
        let x = activations(m, k, 3);
        let reference = packed.matmul_at(Level::Portable, &x, m);
        for level in Level::available() {
            let acts = Acts::new(level, &x, k, packed.quant());
            let mut y = vec![f32::NAN; m * n];
            // One task over every row: three slices, the last ending in a partly padded panel.
            run_rows(level, &packed, 0..n, &acts, Out { ptr: y.as_mut_ptr(), n, len: y.len() });
            let same = y.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{dtype:?} {level:?}: a sliced task differs from the portable kernels");
        }
    }
}

/// The fused gated feed-forward network is its three products and the gate's activation, one step at a time:
/// SwiGLU and GeGLU, the same bits.
#[test]
fn the_fused_feed_forward_network_is_its_products_and_activation() {
    use elementwise::Activation;
    let (k, hidden, m) = (576, 64, 5);
    let wrap = |q: QTensor| Matrix::Packed(std::sync::Arc::new(Packed::from_qtensor(&q).unwrap().unwrap()));
    let (gate, up, down) = (wrap(matrix(GgmlDType::Q8_0, hidden, k, 1)), wrap(matrix(GgmlDType::Q4_1, hidden, k, 2)), wrap(matrix(GgmlDType::F16, k, hidden, 3)));
    let x = activations(m, k, 4);
    let mut outputs = Vec::new();
    for act in [Activation::Silu, Activation::GeluTanh] {
        let fused = Matrix::ffn_host(&x, m, &gate, &up, &down, act).unwrap().expect("packed matrices");
        let [mut g, u]: [Vec<f32>; 2] = Matrix::products_host(&x, m, &[&gate, &up]).unwrap().unwrap().try_into().unwrap();
        elementwise::gated(act, &mut g, &u);
        let stepwise = Matrix::products_host(&g, m, &[&down]).unwrap().unwrap().remove(0);
        assert_eq!(fused.len(), m * k);
        assert!(fused.iter().zip(&stepwise).all(|(a, b)| a.to_bits() == b.to_bits()), "{act:?}");
        outputs.push(fused);
    }
    assert_ne!(outputs[0], outputs[1], "the activation is applied");
}

/// `auto` on a CPU with AMX: a decode step's 16 rows take the tiles for k-quant products of 4 M weights (Llama-3.2-1B's
/// attention output projection) but not for the per-32 layouts' products below 8 M, and 15 rows never do. Where the
/// CPU or Linux gives no AMX the choice is never made, and the test says so.
#[test]
fn auto_hands_decode_steps_of_k_quant_products_to_the_tiles_from_4m_weights() {
    if Level::active() != Level::Vnni || !Level::available().contains(&Level::Amx) {
        eprintln!("no AMX level here (or another level is forced): auto's tile choice is not made, not checked");
        return;
    }
    let layout = |data: Data, n: usize| Packed { n, k: 2048, stored: GgmlDType::Q4K, data };
    let k4 = || Data::K4 { qs: Vec::new(), sc: Vec::new(), mn: Vec::new(), d: Vec::new(), dmin: Vec::new() };
    let (attention_out, narrow) = (layout(k4(), 2048), layout(k4(), 1024));
    let q4 = layout(Data::Q4 { qs: Vec::new(), d: Vec::new(), m: Vec::new() }, 2048);
    // Other tests' products may take the tiles while this holds: the same bits either way.
    AUTO_TILES.store(true, Ordering::Relaxed);
    let chosen = [model_level(&[&attention_out], 16), model_level(&[&attention_out], 15), model_level(&[&narrow], 16), model_level(&[&q4], 16), model_level(&[&q4], 32)];
    AUTO_TILES.store(false, Ordering::Relaxed);
    assert_eq!(chosen, [Level::Amx, Level::Vnni, Level::Vnni, Level::Vnni, Level::Amx]);
}
