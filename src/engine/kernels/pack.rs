//! GGUF weight blocks decoded into the kernels' layouts, without changing a value.
//!
//! Every quantized type the kernels take stores, per group of 16 or 32 weights, small unsigned integers `q` and
//! a scale and an offset such that the weight is `d * q + m` (types with a signed code, `d * (q - c)`, have
//! `m = -c * d`; the k-quants' sub-block scales `d * sc` and mins `dmin * mn` are products of an f16 and an
//! integer of at most 8 bits, which f32 holds exactly). Q8_0 and Q5_0 are kept signed, `d * code` (Q5_0's code is
//! `q - 16`): the layout with the cheapest products, one scale per 32, which `auto` hands to AMX's int8 tiles (without
//! the tile unit, Q5_0 keeps its 5-bit codes `q` in five bits each, `Data::S5`). Q4_0
//! keeps its 4-bit codes with no offsets stored: they stand for `d * (q - 8)`. The k-quants keep their own
//! scales: Q6_K one signed 8-bit `sc` per 16 and an f16 `d` per 256 (`d * sc * (q - 32)`), Q3_K the same with its
//! 6-bit scales less 32 and its 3-bit codes in bit planes (`d * sc * (q - 4)`), Q4_K and Q5_K a 6-bit
//! `sc` and `mn` per 32 and an f16 `d` and `dmin` per 256 (`d * sc * q - dmin * mn`): the kernels multiply the
//! small scales in as integers. The codes are copied, the scales kept as the file's f16 (Q5_1's, Q6_K's and Q3_K's
//! widened to f32): every weight the kernels compute with is the one the file stores.

use candle_core::quantized::GgmlDType;
use half::f16;

use super::{Data, Level, Packed, PANEL};

/// Bytes per block and weights per block of a GGUF type the kernels take, or `None`.
fn block_size(dtype: GgmlDType) -> Option<(usize, usize)> {
    Some(match dtype {
        GgmlDType::Q4_0 => (18, 32),
        GgmlDType::Q4_1 => (20, 32),
        GgmlDType::Q5_0 => (22, 32),
        GgmlDType::Q5_1 => (24, 32),
        GgmlDType::Q8_0 => (34, 32),
        GgmlDType::Q3K => (110, 256),
        GgmlDType::Q4K => (144, 256),
        GgmlDType::Q5K => (176, 256),
        GgmlDType::Q6K => (210, 256),
        GgmlDType::F16 | GgmlDType::BF16 => (16, 8),
        _ => return None,
    })
}

fn half_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The k-quants' 6-bit scale and min of sub-block `j` (of 8), from their 12 packed bytes.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Calls `group(codes, d, m)` for each group of 16 weights of one block, in order: weight `i` of the group is
/// `d * codes[i] + m`.
fn decode_block(dtype: GgmlDType, b: &[u8], group: &mut impl FnMut(&[u8; 16], f32, f32)) {
    let mut codes = [0u8; 32];
    // A block of 32 with one scale and offset, its codes in `codes`.
    let emit32 = |codes: &[u8; 32], d: f32, m: f32, group: &mut dyn FnMut(&[u8; 16], f32, f32)| {
        group(codes[..16].try_into().expect("16"), d, m);
        group(codes[16..].try_into().expect("16"), d, m);
    };
    match dtype {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 => {
            let (d, qs) = (half_at(b, 0), if dtype == GgmlDType::Q4_0 { &b[2..18] } else { &b[4..20] });
            let m = if dtype == GgmlDType::Q4_0 { -8.0 * d } else { half_at(b, 2) };
            for j in 0..16 {
                codes[j] = qs[j] & 0xF;
                codes[j + 16] = qs[j] >> 4;
            }
            emit32(&codes, d, m, group);
        }
        GgmlDType::Q5_0 | GgmlDType::Q5_1 => {
            let d = half_at(b, 0);
            let (m, rest) = if dtype == GgmlDType::Q5_0 { (-16.0 * d, &b[2..]) } else { (half_at(b, 2), &b[4..]) };
            let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let qs = &rest[4..20];
            for j in 0..16 {
                codes[j] = (qs[j] & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                codes[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            }
            emit32(&codes, d, m, group);
        }
        GgmlDType::Q8_0 | GgmlDType::Q3K | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => unreachable!("{dtype:?} is not decoded to codes with a float scale per group"),
        _ => unreachable!("decode_block for a type block_size refuses"),
    }
}

/// A Q6_K block's 256 codes `q` (0..=63, in order), its 16 signed scales (one per 16 weights) and its f16 scale
/// `d`: weight `i` is `d * sc[i / 16] * (q[i] - 32)`.
fn q6k_block(b: &[u8]) -> ([u8; 256], [i8; 16], f32) {
    let (ql, qh, scales, d) = (&b[0..128], &b[128..192], &b[192..208], half_at(b, 208));
    // Two halves of 128 weights; in each, 64 bytes of low nibbles and 32 of two-bit high parts.
    let mut codes = [0u8; 256];
    for h in 0..2 {
        let (ql, qh, y) = (&ql[64 * h..], &qh[32 * h..], &mut codes[128 * h..]);
        for l in 0..32 {
            y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    (codes, std::array::from_fn(|g| scales[g] as i8), d)
}

/// A Q3_K block's 256 codes `c` (0..=7, in order: ggml's two low bits, plus 4 where the high bit is set), its 16
/// signed scales (`sc - 32` of its 6-bit scales, one per 16 weights) and its f16 scale `d`: weight `i` is `d *
/// sc[i / 16] * (c[i] - 4)` (ggml's `d * (sc - 32) * (q - (h ? 0 : 4))`).
fn q3k_block(b: &[u8]) -> ([u8; 256], [i8; 16], f32) {
    let (hmask, qs, scales, d) = (&b[0..32], &b[32..96], &b[96..108], half_at(b, 108));
    // Two halves of 128 weights; weight `32 j + t` of half `n` has its low bits at bits `2 j` of `qs[32 n + t]` and
    // its high bit at bit `4 n + j` of `hmask[t]`.
    let mut codes = [0u8; 256];
    for n in 0..2 {
        for j in 0..4 {
            for t in 0..32 {
                codes[128 * n + 32 * j + t] = ((qs[32 * n + t] >> (2 * j)) & 3) | ((hmask[t] >> (4 * n + j)) & 1) << 2;
            }
        }
    }
    // Sixteen 6-bit scales, four quarters of four: quarter `u`'s low nibbles are the low (`u < 2`) or high nibbles
    // of bytes `4 (u % 2)..`, its two high bits bits `2 u` of bytes `8..12`.
    let sc = std::array::from_fn(|i| {
        let (u, j) = (i / 4, i % 4);
        let low = (scales[4 * (u % 2) + j] >> (4 * (u / 2))) & 0xF;
        (low | ((scales[8 + j] >> (2 * u)) & 3) << 4) as i8 - 32
    });
    (codes, sc, d)
}

/// A Q4_K block's (`five`: Q5_K's) 256 codes `q` (0..=15, or 0..=31, in order), its 8 scales and mins (6 bits
/// each, one per 32 weights) and its f16 `d` and `dmin` as stored (bits): weight `i` is `d * sc[i / 32] * q[i] -
/// dmin * mn[i / 32]`.
pub(super) fn kmin_block(b: &[u8], five: bool) -> ([u8; 256], [u8; 8], [u8; 8], u16, u16) {
    let (d, dmin, scales) = (u16::from_le_bytes([b[0], b[1]]), u16::from_le_bytes([b[2], b[3]]), &b[4..16]);
    let (qh, qs) = if five { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
    let mut codes = [0u8; 256];
    // Four chunks of 64 weights: 32 bytes, low nibbles the chunk's first 32 weights, high nibbles its last 32;
    // Q5_K's fifth bits are bits 2c and 2c + 1 of 32 shared bytes.
    for c in 0..4 {
        for l in 0..32 {
            let high = |bit: usize| qh.map_or(0, |qh| ((qh[l] >> bit) & 1) << 4);
            codes[64 * c + l] = (qs[32 * c + l] & 0xF) | high(2 * c);
            codes[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | high(2 * c + 1);
        }
    }
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for (j, (sc, mn)) in sc.iter_mut().zip(&mut mn).enumerate() {
        (*sc, *mn) = scale_min_k4(j, scales);
    }
    (codes, sc, mn, d, dmin)
}

/// A GGUF matrix `[n, k]` of `dtype` (its raw bytes as stored) in the kernels' layout, or `None` when the kernels
/// do not take it: another type, a width that is not a whole number of blocks, or a Q8_0 matrix holding the code
/// -128 (the kernels' signed product needs codes in -127..=127; ggml never writes -128). A byte count that does
/// not match the shape is an error.
pub(super) fn pack(dtype: GgmlDType, bytes: &[u8], n: usize, k: usize) -> Result<Option<Packed>, String> {
    pack_with(dtype, bytes, n, k, narrow_codes())
}

/// Whether Q6_K, Q5_K, Q5_1 and Q5_0 matrices are held in the file's bits a code ([`Data::Q6N`], [`Data::K5N`],
/// [`Data::U5`], [`Data::S5`]) rather than a code to a byte ([`Data::Q6`], [`Data::K5`], [`Data::U8`], [`Data::S8`]):
/// wherever the process will not take the tile unit, whose int8 tiles read the bytes.
pub(super) fn narrow_codes() -> bool {
    Level::detected() != Level::Amx
}

/// [`pack`], with Q6_K, Q5_K, Q5_1 and Q5_0 held as [`Data::Q6N`], [`Data::K5N`], [`Data::U5`] and [`Data::S5`] when
/// `narrow`, as [`Data::Q6`], [`Data::K5`], [`Data::U8`] and [`Data::S8`] otherwise.
pub(super) fn pack_with(dtype: GgmlDType, bytes: &[u8], n: usize, k: usize, narrow: bool) -> Result<Option<Packed>, String> {
    let Some((block_bytes, block_len)) = block_size(dtype) else { return Ok(None) };
    if n == 0 || k == 0 || !k.is_multiple_of(block_len) || !k.is_multiple_of(32) && !matches!(dtype, GgmlDType::F16 | GgmlDType::BF16) {
        return Ok(None);
    }
    let expected = n.checked_mul(k / block_len).and_then(|b| b.checked_mul(block_bytes));
    if expected != Some(bytes.len()) {
        return Err(format!("{dtype:?} matrix [{n}, {k}] should have {expected:?} bytes, has {}", bytes.len()));
    }
    // Panel by panel (`PANEL` rows: a contiguous part of every output), so that only the packed matrix and one
    // panel's decoded codes are held at once (decoding the whole matrix first held three times its codes: for a
    // Llama 3 output projection in Q6_K, 0.75 GiB for a moment).
    let row_bytes = k / block_len * block_bytes;
    let panels = bytes.chunks(PANEL * row_bytes).map(|panel| (panel, panel.len() / row_bytes));
    let data = match dtype {
        GgmlDType::F16 | GgmlDType::BF16 => {
            let w: Vec<u16> = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            if dtype == GgmlDType::F16 { Data::F16(w) } else { Data::Bf16(w) }
        }
        GgmlDType::Q8_0 | GgmlDType::Q5_0 => {
            // Signed codes with one scale per 32: Q8_0's as stored; Q5_0's 5-bit code `q` stands for `d * (q - 16)`,
            // so its signed code is `q - 16` (-16..=15), and `d * (q - 16)` is the weight exactly (an f16 times an
            // integer of 5 bits).
            // With `narrow`, Q5_0 as `Data::S5`: its codes `q` in five bits each.
            let five = dtype == GgmlDType::Q5_0 && narrow;
            let (mut qs, mut ds) = (Vec::with_capacity(n.div_ceil(PANEL) * PANEL * if five { k / 32 * 20 } else { k }), Vec::with_capacity(n.div_ceil(PANEL) * PANEL * k / 32));
            let (mut codes, mut d) = (Vec::with_capacity(PANEL * k), Vec::with_capacity(PANEL * k / 32));
            let mut small = true;
            for (panel, rows) in panels {
                codes.clear();
                d.clear();
                for b in panel.chunks_exact(block_bytes) {
                    d.push(u16::from_le_bytes([b[0], b[1]]));
                    if dtype == GgmlDType::Q8_0 {
                        codes.extend(b[2..].iter().copied());
                    } else if five {
                        // `Data::S5`: the codes `q` as stored.
                        decode_block(dtype, b, &mut |group, _, _| codes.extend_from_slice(group));
                    } else {
                        // Both halves of the block carry its one scale; only the codes are taken.
                        decode_block(dtype, b, &mut |group, _, _| codes.extend(group.iter().map(|&q| (q as i8 - 16) as u8)));
                    }
                }
                if five {
                    qs.extend(chunks(rows, k, &codes, false).chunks_exact(256).flat_map(five_bits_and_pairs));
                    ds.extend(lanes(rows, k / 32, &d));
                    continue;
                }
                if codes.contains(&0x80) {
                    return Ok(None);
                }
                small &= codes.iter().all(|&c| (-16..=15).contains(&(c as i8)));
                qs.extend(chunks(rows, k, &codes, false).into_iter().map(|c| c ^ 0x80));
                ds.extend(lanes(rows, k / 32, &d));
            }
            if five { Data::S5 { qs, d: ds } } else { Data::S8 { qs, d: ds, small } }
        }
        GgmlDType::Q4K | GgmlDType::Q5K => {
            // The codes as Q4_1's nibbles (Q5_K's one per byte, as `U8`); the scales and mins per 32 as they are (the
            // mins in pairs of blocks), `d` and `-dmin` per 256 as the file's f16 (negating flips the sign bit).
            let supers = k / 256;
            let (mut qs, mut sc, mut mn, mut ds, mut dmins) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (mut codes, mut scales, mut mins, mut d, mut dmin) = (Vec::with_capacity(PANEL * k), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (panel, rows) in panels {
                codes.clear();
                scales.clear();
                mins.clear();
                d.clear();
                dmin.clear();
                for b in panel.chunks_exact(block_bytes) {
                    let (c, s, m, db, dm) = kmin_block(b, dtype == GgmlDType::Q5K);
                    codes.extend_from_slice(&c);
                    scales.extend_from_slice(&s);
                    mins.extend_from_slice(&m);
                    d.push(db);
                    dmin.push(dm ^ 0x8000);
                }
                let bytes = chunks(rows, k, &codes, dtype == GgmlDType::Q4K);
                if dtype == GgmlDType::Q5K && narrow {
                    qs.extend(bytes.chunks_exact(256).flat_map(five_bits_and_pairs));
                } else {
                    qs.extend(bytes);
                }
                sc.extend(lanes(rows, k / 32, &scales));
                ds.extend(lanes(rows, supers, &d));
                dmins.extend(lanes(rows, supers, &dmin));
                // `[super, block, lane]` to `[super, pair of blocks, lane, 2]`.
                let by_lane = lanes(rows, k / 32, &mins);
                for s in 0..supers {
                    for t in 0..4 {
                        for l in 0..PANEL {
                            mn.extend((0..2).map(|e| by_lane[(8 * s + 2 * t + e) * PANEL + l]));
                        }
                    }
                }
            }
            match (dtype == GgmlDType::Q4K, narrow) {
                (true, _) => Data::K4 { qs, sc, mn, d: ds, dmin: dmins },
                (false, true) => Data::K5N { qs, sc, mn, d: ds, dmin: dmins },
                (false, false) => Data::K5 { qs, sc, mn, d: ds, dmin: dmins },
            }
        }
        GgmlDType::Q6K | GgmlDType::Q3K => {
            // Q6_K's 6-bit codes one per byte, as `U8`, or with `narrow` in `Data::Q6N`'s 192 bytes per panel and
            // block (Q3_K's 3-bit codes in `Data::K3`'s bit planes); the signed scales per 16 as they are; `d` per
            // 256 widened.
            let three = dtype == GgmlDType::Q3K;
            let (mut qs, mut sc, mut ds) = (Vec::new(), Vec::new(), Vec::new());
            let (mut codes, mut scales, mut d) = (Vec::with_capacity(PANEL * k), Vec::with_capacity(PANEL * k / 16), Vec::with_capacity(PANEL * k / 256));
            for (panel, rows) in panels {
                codes.clear();
                scales.clear();
                d.clear();
                for b in panel.chunks_exact(block_bytes) {
                    let (c, s, db) = if three { q3k_block(b) } else { q6k_block(b) };
                    codes.extend_from_slice(&c);
                    scales.extend_from_slice(&s);
                    d.push(db);
                }
                let bytes = chunks(rows, k, &codes, false);
                if three {
                    qs.extend(bytes.chunks_exact(256).flat_map(bit_planes));
                } else if narrow {
                    qs.extend(bytes.chunks_exact(256).flat_map(six_bits_and_nibbles));
                } else {
                    qs.extend(bytes);
                }
                sc.extend(lanes(rows, k / 16, &scales));
                ds.extend(lanes(rows, k / 256, &d));
            }
            match (three, narrow) {
                (true, _) => Data::K3 { qs, sc, d: ds },
                (false, true) => Data::Q6N { qs, sc, d: ds },
                (false, false) => Data::Q6 { qs, sc, d: ds },
            }
        }
        _ => {
            // Per panel: row-major codes and a scale and offset per 16, then the panel's layout. Q4_0's and Q4_1's
            // scales and offsets per 32, as the file's f16 bits; with `narrow`, Q5_1's per 32, widened.
            let halves = matches!(dtype, GgmlDType::Q4_0 | GgmlDType::Q4_1);
            let five = dtype == GgmlDType::Q5_1 && narrow;
            let (panels_n, per_row) = (n.div_ceil(PANEL), if halves { k / 32 } else { k / 16 });
            let mut qs = Vec::with_capacity(panels_n * PANEL * if halves { k / 2 } else if five { k / 32 * 20 } else { k });
            let per = if halves { 0 } else { panels_n * PANEL * if five { k / 32 } else { per_row } };
            let (mut ds, mut ms) = (Vec::with_capacity(per), Vec::with_capacity(per));
            // Q4_0's and Q4_1's: f16 bits.
            let per32 = |held: bool| Vec::with_capacity(if held { panels_n * PANEL * (k / 32) } else { 0 });
            let (mut d4, mut m4) = (per32(halves), per32(dtype == GgmlDType::Q4_1));
            let (mut codes, mut d, mut m) = (Vec::with_capacity(PANEL * k), Vec::with_capacity(PANEL * k / 16), Vec::with_capacity(PANEL * k / 16));
            for (panel, rows) in panels {
                codes.clear();
                d.clear();
                m.clear();
                for b in panel.chunks_exact(block_bytes) {
                    decode_block(dtype, b, &mut |group, dg, mg| {
                        codes.extend_from_slice(group);
                        d.push(dg);
                        m.push(mg);
                    });
                }
                if halves {
                    // The two halves of a block of 32 share a scale and an offset (`decode_block` emits them twice),
                    // the file's f16s: back to their bits (exact).
                    let bits = |v: &Vec<f32>| v.iter().step_by(2).map(|&v| f16::from_f32(v).to_bits()).collect::<Vec<u16>>();
                    qs.extend(chunks(rows, k, &codes, true));
                    d4.extend(lanes(rows, k / 32, &bits(&d)));
                    // Q4_0's offset is always `-8 d`: kept as the codes' meaning, `d * (code - 8)`, not stored.
                    if dtype != GgmlDType::Q4_0 {
                        m4.extend(lanes(rows, k / 32, &bits(&m)));
                    }
                } else if five {
                    // One scale and offset per 32 (`decode_block` emits each block's twice).
                    let once = |v: &Vec<f32>| v.iter().step_by(2).copied().collect::<Vec<f32>>();
                    qs.extend(chunks(rows, k, &codes, false).chunks_exact(256).flat_map(five_bits_and_pairs));
                    ds.extend(lanes(rows, k / 32, &once(&d)));
                    ms.extend(lanes(rows, k / 32, &once(&m)));
                } else {
                    qs.extend(chunks(rows, k, &codes, false));
                    ds.extend(lanes(rows, k / 16, &d));
                    ms.extend(lanes(rows, k / 16, &m));
                }
            }
            match (halves, five) {
                (true, _) => Data::Q4 { qs, d: d4, m: m4 },
                (false, true) => Data::U5 { qs, d: ds, m: ms },
                (false, false) => Data::U8 { qs, d: ds, m: ms },
            }
        }
    };
    Ok(Some(Packed { n, k, stored: dtype, data }))
}

/// Row-major codes `[n, k]`, one per byte, in panels of [`PANEL`] rows (the last zero-padded): per panel and
/// block of 32, chunks of 32 bytes, chunk `g`'s lane `l` (4 bytes) holding row `l`'s codes `4g..4g + 4`; eight
/// chunks, or with `nibbles` four, whose low nibbles hold codes `4g..4g + 4` and high nibbles `16 + 4g..20 + 4g`.
fn chunks(n: usize, k: usize, codes: &[u8], nibbles: bool) -> Vec<u8> {
    let (blocks, per_block) = (k / 32, if nibbles { 128 } else { 256 });
    let mut out = vec![0u8; n.div_ceil(PANEL) * blocks * per_block];
    for (row, codes) in codes.chunks_exact(k).enumerate() {
        let (p, l) = (row / PANEL, row % PANEL);
        for (b, block) in codes.chunks_exact(32).enumerate() {
            let at = (p * blocks + b) * per_block + 4 * l;
            for g in 0..per_block / 32 {
                for j in 0..4 {
                    let code = block[4 * g + j];
                    out[at + 32 * g + j] = if nibbles { code | (block[16 + 4 * g + j] << 4) } else { code };
                }
            }
        }
    }
    out
}

/// One panel and block of 3-bit codes in `chunks`' order (256 bytes, eight chunks of 32) as [`Data::K3`]'s 96 bytes:
/// the two low bits of chunks `4 h..4 h + 4` in bytes `32 h..`, chunk `g`'s at bits `2 (g % 4)`; every chunk's high
/// bit in bytes `64..`, chunk `g`'s at bit `g`.
fn bit_planes(block: &[u8]) -> [u8; 96] {
    let mut out = [0u8; 96];
    for (g, chunk) in block.chunks_exact(32).enumerate() {
        for (at, &c) in chunk.iter().enumerate() {
            out[32 * (g / 4) + at] |= (c & 3) << (2 * (g % 4));
            out[64 + at] |= (c >> 2) << g;
        }
    }
    out
}

/// One panel and block of 5-bit codes in `chunks`' order (256 bytes, eight chunks of 32) as [`Data::K5N`]'s (and
/// [`Data::U5`]'s and [`Data::S5`]'s) 160 bytes: chunk `t < 4` whole in the low five bits of bytes `32 t..`, the
/// low three bits of chunk `t + 4` above it; the two high bits of chunk `4 + t` at bits `2 t`, `2 t + 1` of bytes
/// `128..`.
fn five_bits_and_pairs(block: &[u8]) -> [u8; 160] {
    let mut out = [0u8; 160];
    let chunk = |g: usize| &block[32 * g..32 * g + 32];
    for at in 0..32 {
        for t in 0..4 {
            out[32 * t + at] = chunk(t)[at] | (chunk(t + 4)[at] & 7) << 5;
        }
        out[128 + at] = (0..4).map(|t| (chunk(t + 4)[at] >> 3) << (2 * t)).sum();
    }
    out
}

/// One panel and block of 6-bit codes in `chunks`' order (256 bytes, eight chunks of 32) as [`Data::Q6N`]'s 192
/// bytes: chunk `t < 4` whole in the low six bits of bytes `32 t..`, with chunk `t + 4`'s two high bits above it;
/// the low four bits of chunks `4 + 2 h` and `5 + 2 h` in the nibbles of bytes `128 + 32 h..`.
fn six_bits_and_nibbles(block: &[u8]) -> [u8; 192] {
    let mut out = [0u8; 192];
    let chunk = |g: usize| &block[32 * g..32 * g + 32];
    for at in 0..32 {
        for t in 0..4 {
            out[32 * t + at] = chunk(t)[at] | (chunk(t + 4)[at] >> 4) << 6;
        }
        for h in 0..2 {
            out[128 + 32 * h + at] = (chunk(4 + 2 * h)[at] & 0xF) | (chunk(5 + 2 * h)[at] & 0xF) << 4;
        }
    }
    out
}

/// Per-row values `[n, per_row]` in panels: `[panel, per_row, PANEL]`, a panel's eight rows side by side (the last
/// panel's missing rows zero).
fn lanes<T: Copy + Default>(n: usize, per_row: usize, v: &[T]) -> Vec<T> {
    let mut out = vec![T::default(); n.div_ceil(PANEL) * per_row * PANEL];
    for (row, values) in v.chunks_exact(per_row).enumerate() {
        let (p, l) = (row / PANEL, row % PANEL);
        for (c, &value) in values.iter().enumerate() {
            out[(p * per_row + c) * PANEL + l] = value;
        }
    }
    out
}
