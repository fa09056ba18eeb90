//! The host attention's prefills on Intel's tile unit (`runtime.attention = "host-amx"`): a chunk's scores and its
//! weighted values as the tile unit's bf16 products (`tdpbf16ps`, AMX-BF16), the softmax step between them for 16
//! rows at once ([`softmax_rows`]; Gemma 2's soft-capped scores row by row, [`super::tile::softmax_step`]).
//!
//! Like the F16 weights' products at this level (`kernels::amx`), each operand is split into two bf16 parts, `hi`
//! (to nearest) and `lo` (the rest, to nearest), and the tiles sum `hi·hi + hi·lo + lo·hi` in f32: each product
//! within about 2^-16 of the exact one (`lo·lo`, under 2^-16 of it, is left out), where the other levels compute
//! it exactly in f32. So this attention differs from the f32 one in the last bits, within that bound (tested
//! against an f64 softmax: within 1e-5 of it, as the f32 attention is); it runs only where the job names it,
//! never under `auto`, and the results' numerics say so. Steps of one new token (decodes, and a prompt a prefix
//! cache hit leaves one token short) stay in f32: such a row, or a sequence preempted and recomputed (its generated
//! tokens then prefilled), may differ in its last bits from the same row run otherwise.
//!
//! On a 2-core Sapphire Rapids VM: 1.4-1.8x the f32 attention's speed on the 1B's prefills (`bench kernels`),
//! where the tiles' products are now a third of its time and the rest the softmax, the layouts and the weights'
//! split (BENCHMARKS.md).
//!
//! Per chunk of [`CHUNK`] positions: the keys of each block laid out as the tiles' `B` (pairs of dimensions to a
//! 32-bit lane: [`lay_keys`]), a tile of 16 query rows against them ([`scores`]: 16 x 16 scores per block, summed
//! over the head's dimensions 32 at a time), the softmax step in f32, the weights split into bf16 parts, and the
//! values laid out as `B` (pairs of positions to a lane: [`lay_values`]) for the weighted sum ([`weighted`]: 16
//! rows by 16 dimensions per tile, over the chunk's positions 32 at a time), added into each row's output.
//! Every row's arithmetic depends only on its own query and the blocks, never on the other rows of its tile, so
//! how rows are grouped into tasks changes no bit, and a cached prefix gives the bits of a full prefill.

use std::arch::asm;
use std::arch::x86_64::*;

use super::tile::CHUNK;
use super::BLOCK;

/// Rows of every tile: query rows, or pairs of dimensions (keys) or positions (values).
pub const ROWS: usize = 16;
/// bf16 values per tile row (64 bytes): 16 pairs.
const LINE: usize = 32;
/// bf16 values per tile.
pub const TILE: usize = ROWS * LINE;

const _: () = assert!(BLOCK == 16 && CHUNK == 64, "the tile attention takes blocks of 16 positions, chunks of 64");

/// Whether this CPU and process run the tile attention: Linux granted the tiles and the CPU has AMX-BF16 (and
/// AVX-512 F and BW, which [`crate::engine::kernels::amx_bf16_granted`] includes).
pub fn available(head_dim: usize) -> bool {
    head_dim.is_multiple_of(64) && crate::engine::kernels::amx_bf16_granted()
}

/// A palette-1 tile configuration: tiles 0-7, each 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

/// Configures the tiles for this module's products; [`release`] after.
///
/// Safety: [`available`] said yes.
pub unsafe fn configure() {
    let mut c = [0u8; 64];
    c[0] = 1;
    for t in 0..8 {
        c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        c[48 + t] = ROWS as u8;
    }
    let config = Config(c);
    // SAFETY: a valid palette-1 configuration (every tile 16 rows of 64 bytes), 64 bytes; the CPU has the tiles and
    // Linux granted them (the caller's contract).
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
}

/// Releases the tiles ([`configure`]).
///
/// Safety: [`available`] said yes.
pub unsafe fn release() {
    // SAFETY: no operands; the tiles return to their initial state.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// `a[c]` and `b[c]` (16 each) interleaved, `a[0], b[0], a[1], b[1], ...`, and split into bf16 parts: one tile row
/// of pairs, `hi` and `lo` (32 each).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pair_row(a: &[f32], b: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    let (a, b) = (&a[..16], &b[..16]);
    let first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    let second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    let mut pairs = [0f32; 32];
    // SAFETY: 16 floats at `a` and at `b` (sliced above), 32 in `pairs`; the CPU has AVX-512 F.
    unsafe {
        let (va, vb) = (_mm512_loadu_ps(a.as_ptr()), _mm512_loadu_ps(b.as_ptr()));
        _mm512_storeu_ps(pairs.as_mut_ptr(), _mm512_permutex2var_ps(va, first, vb));
        _mm512_storeu_ps(pairs.as_mut_ptr().add(16), _mm512_permutex2var_ps(va, second, vb));
    }
    crate::engine::kernels::split_bf16_parts(&pairs, &mut hi[..LINE], &mut lo[..LINE]);
}

/// One block's keys (`[head_dim][16]`, as the cache holds them, widened) as the tiles' `B`: per 32 dimensions `g`,
/// a `hi` tile and a `lo` tile (`out[(2 g + part) * TILE..]`), row `r` holding dimensions `32 g + 2 r` and `+ 1`
/// of each of the 16 positions.
#[target_feature(enable = "avx512f,avx512bw")]
pub fn lay_keys(keys: &[f32], head_dim: usize, out: &mut [u16]) {
    assert!(keys.len() == head_dim * BLOCK && out.len() == 2 * head_dim / LINE * TILE, "key layout lengths (a bug)");
    for g in 0..head_dim / LINE {
        let (hi, lo) = out[2 * g * TILE..(2 * g + 2) * TILE].split_at_mut(TILE);
        for r in 0..ROWS {
            let d = LINE * g + 2 * r;
            pair_row(&keys[d * BLOCK..], &keys[(d + 1) * BLOCK..], &mut hi[r * LINE..], &mut lo[r * LINE..]);
        }
    }
}

/// Two blocks' values (`[16][head_dim]` each, widened; an empty slice for a block no row sees, laid out as zeros)
/// as the tiles' `B` for 32 positions: per 16 dimensions `j`, a `hi` tile and a `lo` tile (`out[(2 j + part) *
/// TILE..]`), row `r` holding positions `2 r` and `2 r + 1` of the 32 at each of the 16 dimensions.
#[target_feature(enable = "avx512f,avx512bw")]
pub fn lay_values(values: [&[f32]; 2], head_dim: usize, out: &mut [u16]) {
    assert!(out.len() == 2 * head_dim / ROWS * TILE, "value layout lengths (a bug)");
    for j in 0..head_dim / ROWS {
        let (hi, lo) = out[2 * j * TILE..(2 * j + 2) * TILE].split_at_mut(TILE);
        for r in 0..ROWS {
            let (block, p) = (values[r / 8], 2 * r % BLOCK);
            if block.is_empty() {
                hi[r * LINE..(r + 1) * LINE].fill(0);
                lo[r * LINE..(r + 1) * LINE].fill(0);
                continue;
            }
            assert!(block.len() == BLOCK * head_dim, "a value block's length (a bug)");
            pair_row(&block[p * head_dim + ROWS * j..], &block[(p + 1) * head_dim + ROWS * j..], &mut hi[r * LINE..], &mut lo[r * LINE..]);
        }
    }
}

/// One of a step's three products for each of tiles `C` 0-3: `C_c += A·B_c`, `A` tile 4 (the `hi` parts) or 5 (the
/// `lo` parts), each `B_c` loaded here from `b[c]` into tile 6 or 7 in turn. A step is three such passes, `A_hi·B_hi`,
/// `A_hi·B_lo`, `A_lo·B_hi`, so that two products into the same `C` are four apart, as a product waits for the one
/// before into its `C` (the three in a row into one `C` measured the same here: the tiles are not this attention's
/// bound yet, BENCHMARKS.md).
macro_rules! pass {
    ($a:literal, $b:expr) => {{
        let b: [*const u16; 4] = $b;
        asm!(
            "tileloadd tmm6, [{b0} + {line}*1]",
            concat!("tdpbf16ps tmm0, tmm", $a, ", tmm6"),
            "tileloadd tmm7, [{b1} + {line}*1]",
            concat!("tdpbf16ps tmm1, tmm", $a, ", tmm7"),
            "tileloadd tmm6, [{b2} + {line}*1]",
            concat!("tdpbf16ps tmm2, tmm", $a, ", tmm6"),
            "tileloadd tmm7, [{b3} + {line}*1]",
            concat!("tdpbf16ps tmm3, tmm", $a, ", tmm7"),
            b0 = in(reg) b[0], b1 = in(reg) b[1], b2 = in(reg) b[2], b3 = in(reg) b[3], line = in(reg) 64usize, options(nostack, readonly),
        )
    }};
}

/// Loads `A`'s two parts into tiles 4 and 5: 16 rows of 64 bytes at `hi` and `lo`, `stride` bytes apart.
///
/// Safety: tiles configured ([`configure`]); 16 rows of 64 bytes readable at each.
#[inline(always)]
unsafe fn load_a(hi: *const u16, lo: *const u16, stride: usize) {
    // SAFETY: the caller's contract.
    unsafe { asm!("tileloadd tmm4, [{h} + {s}*1]", "tileloadd tmm5, [{l} + {s}*1]", h = in(reg) hi, l = in(reg) lo, s = in(reg) stride, options(nostack, readonly)) };
}

/// Zeroes tiles 0-3.
///
/// Safety: tiles configured ([`configure`]).
#[inline(always)]
unsafe fn zero_c() {
    // SAFETY: no memory operands.
    unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem)) };
}

/// Stores tiles 0-3 (16 rows of 16 f32 each): tile `c` at `out + c * step` bytes, its rows `stride` bytes apart.
///
/// Safety: tiles configured ([`configure`]); 16 rows of 64 bytes writable at `out + c * step`, `stride` apart.
#[inline(always)]
unsafe fn store_c(out: *mut f32, step: usize, stride: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        let o = out.cast::<u8>();
        asm!(
            "tilestored [{o0} + {s}*1], tmm0", "tilestored [{o1} + {s}*1], tmm1", "tilestored [{o2} + {s}*1], tmm2", "tilestored [{o3} + {s}*1], tmm3",
            o0 = in(reg) o, o1 = in(reg) o.add(step), o2 = in(reg) o.add(2 * step), o3 = in(reg) o.add(3 * step), s = in(reg) stride, options(nostack),
        )
    };
}

/// Scores of 16 query rows (`q` their parts, `[16][head_dim]` each) against a chunk's four blocks of keys (`keys`,
/// [`lay_keys`]'s layout per block, one after another), into `out` (`[16][CHUNK]`, block `s` at columns `16 s..`).
///
/// Safety: tiles configured ([`configure`]).
pub unsafe fn scores(q: [&[u16]; 2], keys: &[u16], head_dim: usize, out: &mut [f32]) {
    let steps = head_dim / LINE;
    assert!(q[0].len() == ROWS * head_dim && q[1].len() == ROWS * head_dim && keys.len() == 4 * 2 * steps * TILE && out.len() == ROWS * CHUNK, "score tiles' lengths (a bug)");
    // SAFETY (every tile load and store below): `q` holds 16 rows of `head_dim` (asserted) and step `g` reads 32
    // values of each, `head_dim * 2` bytes apart; block `s`'s step `g` is `2 TILE` values (2 KiB) of `keys` at
    // `(2 (s steps + g)) TILE` (asserted length); `out` holds 16 rows of `CHUNK` floats, block `s`'s 16 columns at
    // `16 s`, `CHUNK * 4` bytes apart. The tiles are configured (the caller's contract).
    unsafe {
        zero_c();
        for g in 0..steps {
            load_a(q[0].as_ptr().add(LINE * g), q[1].as_ptr().add(LINE * g), 2 * head_dim);
            // Block `s`'s `hi` tile for this step, its `lo` tile `TILE` values after.
            let hi: [*const u16; 4] = std::array::from_fn(|s| keys.as_ptr().add(2 * (s * steps + g) * TILE));
            pass!("4", hi);
            pass!("4", hi.map(|b| b.add(TILE)));
            pass!("5", hi);
        }
        store_c(out.as_mut_ptr(), 4 * ROWS, 4 * CHUNK);
    }
}

/// The weighted values of 16 rows (`w` their weights' parts, `[16][CHUNK]` each) over a chunk's values (`values`,
/// [`lay_values`]'s layout for positions 0-31 then 32-63), added into `out` (`[16][head_dim]`).
///
/// Safety: tiles configured ([`configure`]).
pub unsafe fn weighted(w: [&[u16]; 2], values: &[u16], head_dim: usize, out: &mut [f32]) {
    let slices = head_dim / ROWS;
    assert!(w[0].len() == ROWS * CHUNK && w[1].len() == ROWS * CHUNK && values.len() == 2 * 2 * slices * TILE && out.len() == ROWS * head_dim, "weighted tiles' lengths (a bug)");
    let mut sums = [[[0f32; ROWS]; ROWS]; 4];
    for j0 in (0..slices).step_by(4) {
        // SAFETY (every tile load and store below): `w` holds 16 rows of `CHUNK` values (asserted), half `h`'s 32
        // at `32 h`, `CHUNK * 2` bytes apart; half `h`'s slice `j` is `2 TILE` values at `2 (h slices + j) TILE` of
        // `values` (asserted length; `j < slices`, a multiple of 4 as `head_dim` is of 64); `sums` holds four tiles
        // of 16 x 16 floats, 1 KiB apart. The tiles are configured (the caller's contract).
        unsafe {
            zero_c();
            for h in 0..2 {
                load_a(w[0].as_ptr().add(LINE * h), w[1].as_ptr().add(LINE * h), 2 * CHUNK);
                let hi: [*const u16; 4] = std::array::from_fn(|j| values.as_ptr().add(2 * (h * slices + j0 + j) * TILE));
                pass!("4", hi);
                pass!("4", hi.map(|b| b.add(TILE)));
                pass!("5", hi);
            }
            store_c(sums.as_mut_ptr().cast(), 4 * ROWS * ROWS, 4 * ROWS);
        }
        for (j, tile) in sums.iter().enumerate() {
            for (i, row) in tile.iter().enumerate() {
                for (o, s) in out[i * head_dim + ROWS * (j0 + j)..][..ROWS].iter_mut().zip(row) {
                    *o += s;
                }
            }
        }
    }
}

/// The softmax step of up to 16 rows of a tile at once ([`super::tile::softmax_step`]'s, unscaled scores without
/// soft-capping): per row `i`, of `scores` (`[16][CHUNK]`) it sees chunk positions `ranges[i]`; they become its weights
/// (`exp(score x scale - max)`, 0 where unseen), and `max[i]`, `sum[i]` and its output (`out[i]`, `head_dim` wide)
/// are rescaled to the new maximum; a row that sees nothing of the chunk is left as it was, its weights 0. The
/// rows' maxima, corrections and sums side by side in vectors: row by row, the scalar exponential of each row's
/// correction and the reductions' last steps were a chain of dependent operations longer than the tiles' work.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub fn softmax_rows(scores: &mut [f32], ranges: &[(usize, usize)], scale: f32, max: &mut [f32], sum: &mut [f32], out: &mut [f32], head_dim: usize) {
    use crate::engine::kernels::elementwise::exp;
    let n = ranges.len();
    assert!(n <= ROWS && scores.len() == ROWS * CHUNK && max.len() == n && sum.len() == n && out.len() == n * head_dim, "softmax rows' lengths (a bug)");
    let seen = |i: usize| ranges[i].0 < ranges[i].1;
    // Lane `l` of vector `q`: position `16 q + l` of the chunk, seen by row `i` where inside its range.
    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let masks = |i: usize| -> [__mmask16; 4] {
        let (from, to) = (_mm512_set1_epi32(ranges[i].0 as i32), _mm512_set1_epi32(ranges[i].1 as i32));
        std::array::from_fn(|q| {
            let pos = _mm512_add_epi32(iota, _mm512_set1_epi32(16 * q as i32));
            _mm512_cmpge_epi32_mask(pos, from) & _mm512_cmplt_epi32_mask(pos, to)
        })
    };
    let mut old = [0f32; ROWS];
    let mut new = [0f32; ROWS];
    for i in 0..n {
        old[i] = max[i];
        new[i] = max[i];
        if !seen(i) {
            continue;
        }
        let (row, m) = (&scores[i * CHUNK..(i + 1) * CHUNK], masks(i));
        let mut top = _mm512_set1_ps(f32::NEG_INFINITY);
        for (q, &m) in m.iter().enumerate() {
            // SAFETY: 16 floats at `16 q` of the row's 64.
            top = _mm512_mask_max_ps(top, m, top, unsafe { _mm512_loadu_ps(row.as_ptr().add(16 * q)) });
        }
        // max(x * scale) is max(x) * scale exactly: rounding a product by a positive scale keeps order.
        new[i] = max[i].max(_mm512_reduce_max_ps(top) * scale);
    }
    // One vector of the rows' corrections.
    let mut correction = [1f32; ROWS];
    for (c, (o, n)) in correction.iter_mut().zip(old.iter().zip(&new)) {
        *c = exp(o - n);
    }
    for i in 0..n {
        let row: &mut [f32; CHUNK] = (&mut scores[i * CHUNK..(i + 1) * CHUNK]).try_into().expect("a chunk of scores");
        if !seen(i) {
            *row = [0.0; CHUNK];
            continue;
        }
        if correction[i] != 1.0 {
            out[i * head_dim..(i + 1) * head_dim].iter_mut().for_each(|x| *x *= correction[i]);
        }
        let top = new[i];
        for x in row.iter_mut() {
            *x = exp(*x * scale - top);
        }
        let mut total = _mm512_setzero_ps();
        for (q, &m) in masks(i).iter().enumerate() {
            // SAFETY: 16 floats at `16 q` of the row's 64.
            unsafe {
                let p = _mm512_maskz_mov_ps(m, _mm512_loadu_ps(row.as_ptr().add(16 * q)));
                _mm512_storeu_ps(row.as_mut_ptr().add(16 * q), p);
                total = _mm512_add_ps(total, p);
            }
        }
        sum[i] = sum[i] * correction[i] + _mm512_reduce_add_ps(total);
        max[i] = top;
    }
}
