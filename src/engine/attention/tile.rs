//! The host backend's attention arithmetic for one task: a tile of query rows (new tokens of one sequence, times
//! the query heads that share a kv head) against that kv head's blocks, with an online softmax updated once per
//! chunk of [`CHUNK`] positions.
//!
//! Per chunk, three phases, each register-blocked over several rows so that a key or value vector loaded once
//! serves them all: every row's scores against the chunk's keys ([`scores`]), the softmax step of each row
//! ([`softmax_step`]: the running maximum and sum, and the chunk's weights), and the weighted values added into each
//! row's output ([`accumulate`]). A chunk is four blocks (64 positions), so the softmax's bookkeeping (a rescale of
//! the output, two reductions) happens a quarter as often as per block, and chunks start at fixed positions (multiples
//! of [`CHUNK`]), so a row's arithmetic is the same whichever tile, step or cache it is computed in: a cached
//! prefix gives the bits of a full prefill.
//!
//! Every value is computed lane by lane in a fixed order: a score is `fma(q[d], k[d], s)` over the head's dimensions
//! in order, an output element `fma(w[p], v[p], o)` over positions in order, the reductions fixed trees
//! ([`tree`]), the exponential [`exp`]'s operations. So the same source compiled for AVX-512, for AVX2 and FMA, or
//! for any CPU (where `mul_add` is a call) gives the same bits, and how many rows a step blocks together (a choice
//! per level) changes nothing. Positions a row does not see weigh exactly 0 in its sum (`fma(0, v, o)` is `o`).

use super::BLOCK;
pub use crate::engine::kernels::Ahead;
use crate::engine::kernels::elementwise::exp;

/// Blocks per softmax update.
pub const CHUNK_BLOCKS: usize = if BLOCK >= 64 { 1 } else { 64 / BLOCK };
/// Positions per softmax update: the unit of a tile's scores and weights.
pub const CHUNK: usize = CHUNK_BLOCKS * BLOCK;

/// `N` values reduced pairwise, halves first (a fixed order that vectorizes).
#[inline(always)]
pub fn tree<const N: usize>(mut v: [f32; N], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = N / 2;
    while width > 0 {
        for c in 0..width {
            v[c] = op(v[c], v[c + width]);
        }
        width /= 2;
    }
    v[0]
}

/// Scores of `R` consecutive rows against one block of keys stored `[head_dim][BLOCK]`, into the rows' slots of
/// block `slot` of the chunk (`scores` is `[R][CHUNK]`). The rows' queries come transposed ([`transpose`]:
/// `queries[d]` holds the `R` rows' dimension `d`). `R x BLOCK` sums held in registers, each over the head's
/// dimensions in order. Line `d` of `ahead_k` and of `ahead_v` is asked for at dimension `d`.
#[inline(always)]
pub fn scores<const R: usize>(scores: &mut [f32], queries: &[[f32; R]], keys: &[f32], slot: usize, ahead: [Ahead<'_>; 2]) {
    let mut s = [[0f32; BLOCK]; R];
    let (keys, _) = keys.as_chunks::<BLOCK>();
    assert_eq!(queries.len(), keys.len(), "queries and keys of one head width (a bug)");
    // The rows' values of dimension `d` side by side, one array per dimension: no bounds check per row and
    // dimension (they were half the loop's instructions, the queries read row by row).
    for (d, (k, q)) in keys.iter().zip(queries).enumerate() {
        ahead[0].line(d);
        ahead[1].line(d);
        // A local copy: one load of the row for all R rows (borrowed, each row reloads it).
        let k: [f32; BLOCK] = *k;
        for i in 0..R {
            // Each row's value read on its own (a volatile read, which the compiler may not merge with its
            // neighbours): with the R values side by side in memory, LLVM vectorized across the rows at AVX-512,
            // each sum gathered and scattered back per multiply-add, and prefills' attention took 10-14x the time
            // (2-core Zen 4, BENCHMARKS.md 2026-12-08). Read alone, each becomes a broadcast operand of the
            // multiply-adds across the block's positions.
            // SAFETY: `&q[i]` is a reference (so valid, aligned, and to an initialised `f32`), live for the read.
            let qd = unsafe { std::ptr::read_volatile(&q[i]) };
            for c in 0..BLOCK {
                s[i][c] = qd.mul_add(k[c], s[i][c]);
            }
        }
    }
    for (i, s) in s.iter().enumerate() {
        scores[i * CHUNK + slot * BLOCK..][..BLOCK].copy_from_slice(s);
    }
}

/// `R` query rows of `hd` values each (`q[starts[i]..][..hd]`) as [`scores`] takes them, into `out` (`R x hd`
/// values): dimension `d` of row `i` at `out[d R + i]`.
#[inline(always)]
pub fn transpose(q: &[f32], starts: &[usize], hd: usize, out: &mut [f32]) {
    let n = starts.len();
    assert_eq!(out.len(), n * hd, "a query tile's shape (a bug)");
    for (i, &start) in starts.iter().enumerate() {
        for (d, &v) in q[start..][..hd].iter().enumerate() {
            out[d * n + i] = v;
        }
    }
}

/// What shapes a row's softmax: the scale of scores, and Gemma 2's soft-capping.
#[derive(Clone, Copy, Debug)]
pub struct Scoring {
    pub scale: f32,
    pub softcap: Option<f32>,
}

/// One row's softmax step over a chunk: `row` holds its scores, of which it sees chunk positions `from..to`; on
/// return it holds their weights (`exp(score x scale - max)`, 0 where unseen), and `max`, `sum` and `out` (the
/// row's unnormalized output) are rescaled to the new maximum. A row that sees nothing of the chunk is left as
/// it was, its weights all 0.
#[inline(always)]
pub fn softmax_step(row: &mut [f32; CHUNK], from: usize, to: usize, scoring: Scoring, max: &mut f32, sum: &mut f32, out: &mut [f32]) {
    if to <= from {
        *row = [0.0; CHUNK];
        return;
    }
    let (new_max, scale) = chunk_max(row, from, to, scoring, *max);
    let correction = exp(*max - new_max);
    chunk_weights(row, from, to, scale, new_max, correction, max, sum, out);
}

/// [`softmax_step`] for consecutive rows (row `i`: `weights[i x CHUNK..]`, positions `ranges[i]`, `max[i]`, `sum[i]`,
/// `out[i x hd..]`), the same operations on each row. Eight rows' corrections (`exp(max - new max)`) are
/// computed side by side: row by row, each was a chain of two dozen dependent operations between the row's maximum
/// and its weights.
#[inline(always)]
pub fn softmax_rows(weights: &mut [f32], ranges: &[(usize, usize)], scoring: Scoring, max: &mut [f32], sum: &mut [f32], out: &mut [f32], hd: usize) {
    const G: usize = 8;
    let n = ranges.len();
    assert!(weights.len() == n * CHUNK && max.len() == n && sum.len() == n && out.len() == n * hd, "a softmax step's rows (a bug)");
    let (rows, _) = weights.as_chunks_mut::<CHUNK>();
    for g0 in (0..n).step_by(G) {
        let g = (n - g0).min(G);
        // Rows that see nothing of the chunk keep their maximum (a correction of 1, not used).
        let (mut old, mut new, mut scale) = ([0f32; G], [0f32; G], [0f32; G]);
        for i in 0..g {
            let r = g0 + i;
            let (from, to) = ranges[r];
            if to > from {
                (new[i], scale[i]) = chunk_max(&mut rows[r], from, to, scoring, max[r]);
                old[i] = max[r];
            }
        }
        let correction: [f32; G] = std::array::from_fn(|i| exp(old[i] - new[i]));
        for i in 0..g {
            let r = g0 + i;
            let (from, to) = ranges[r];
            if to <= from {
                rows[r] = [0.0; CHUNK];
            } else {
                chunk_weights(&mut rows[r], from, to, scale[i], new[i], correction[i], &mut max[r], &mut sum[r], &mut out[r * hd..(r + 1) * hd]);
            }
        }
    }
}

/// A row's new running maximum over chunk positions `from..to` (at least one) of its scores, and the scale its
/// weights then take: soft-capped scores are capped here, in place, and then scaled by 1.
#[inline(always)]
fn chunk_max(row: &mut [f32; CHUNK], from: usize, to: usize, scoring: Scoring, max: f32) -> (f32, f32) {
    let scale = match scoring.softcap {
        Some(cap) => {
            row[from..to].iter_mut().for_each(|x| *x = cap * (*x * scoring.scale / cap).tanh());
            1.0
        }
        None => scoring.scale,
    };
    // A chunk the row sees whole (every chunk but a row's last, and its first in a sliding window) takes no masks
    // (the same maximum).
    let whole = from == 0 && to == CHUNK;
    let (from, to) = (from as u32, to as u32);
    // max(x * scale) is max(x) * scale exactly: rounding a product by a positive scale keeps order.
    let mut seen = *row;
    if !whole {
        for (c, v) in (0u32..).zip(seen.iter_mut()) {
            if c < from || c >= to {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    // The chunk's maximum by comparisons, one `vmaxps` a step: `f32::max`'s care for NaN (ignoring one) cost a
    // compare and a blend per step, 15-20 % of a prefill's attention. Scores are NaN only where the queries or
    // keys hold one, and then the row's output is NaN either way.
    (max.max(tree(seen, |a, b| if a > b { a } else { b }) * scale), scale)
}

/// The rest of a row's softmax step once its new maximum and `correction = exp(max - new_max)` are known: the
/// weights of positions `from..to` (0 elsewhere), the output rescaled, the sum and maximum updated.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn chunk_weights(row: &mut [f32; CHUNK], from: usize, to: usize, scale: f32, new_max: f32, correction: f32, max: &mut f32, sum: &mut f32, out: &mut [f32]) {
    if correction != 1.0 {
        out.iter_mut().for_each(|x| *x *= correction);
    }
    // A whole chunk without masks: the same operations on the same values as the masked path below, without its
    // compares and selects (positions compared as 32-bit lanes there, 8 to a register on AVX2, where 64-bit
    // indices took 4 and two packs).
    if from == 0 && to == CHUNK {
        for x in row.iter_mut() {
            *x = exp(*x * scale - new_max);
        }
    } else {
        let (from, to) = (from as u32, to as u32);
        for (c, x) in (0u32..).zip(row.iter_mut()) {
            let p = exp(*x * scale - new_max);
            *x = if c >= from && c < to { p } else { 0.0 };
        }
    }
    *sum = *sum * correction + tree(*row, |a, b| a + b);
    *max = new_max;
}

/// `out[i] += sum over chunk positions p in from..to of weights[i][p] x values(p)` for `R` consecutive rows
/// (`out` `[R][head_dim]`, `weights` `[R][CHUNK]`), the chunk's value blocks `[BLOCK][head_dim]` each (a block no
/// row sees may be empty). `R` rows x `W` dimensions in registers across the positions; each element summed in
/// position order.
#[inline(always)]
pub fn accumulate<const R: usize, const W: usize>(out: &mut [f32], weights: &[f32], values: &[&[f32]; CHUNK_BLOCKS], from: usize, to: usize) {
    let hd = out.len() / R;
    assert!(to <= CHUNK && weights.len() >= R * CHUNK && hd.is_multiple_of(W), "a chunk's weighted values (a bug)");
    let w: [&[f32; CHUNK]; R] = std::array::from_fn(|i| weights[i * CHUNK..(i + 1) * CHUNK].try_into().expect("a chunk"));
    for j0 in (0..hd).step_by(W) {
        let mut acc = [[0f32; W]; R];
        for (i, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[i * hd + j0..][..W]);
        }
        let mut p = from;
        while p < to {
            let (b, end) = (p / BLOCK, to.min((p / BLOCK + 1) * BLOCK));
            // This block's positions `p..end`, `W` values of each from dimension `j0`.
            for (p, v) in (p..end).zip(values[b][(p % BLOCK) * hd + j0..].chunks(hd)) {
                let v: [f32; W] = v[..W].try_into().expect("W values");
                for i in 0..R {
                    let w = w[i][p];
                    for j in 0..W {
                        acc[i][j] = w.mul_add(v[j], acc[i][j]);
                    }
                }
            }
            p = end;
        }
        for (i, a) in acc.iter().enumerate() {
            out[i * hd + j0..][..W].copy_from_slice(a);
        }
    }
}

/// [`accumulate`] over any number of rows, `R` at a time and the rest one by one, `W` dimensions at a time where
/// the head's width allows (else the widest that divides it); a row on its own `W1` at a time where the width allows
/// (one row has `R` times fewer chains of multiply-adds to keep the units busy).
#[inline(always)]
pub fn accumulate_rows<const R: usize, const W: usize, const W1: usize>(out: &mut [f32], weights: &[f32], values: &[&[f32]; CHUNK_BLOCKS], ranges: &[(usize, usize)], hd: usize) {
    let rows = ranges.len();
    let span = |rs: &[(usize, usize)]| {
        let from = rs.iter().filter(|r| r.0 < r.1).map(|r| r.0).min().unwrap_or(0);
        let to = rs.iter().filter(|r| r.0 < r.1).map(|r| r.1).max().unwrap_or(0);
        (from, to)
    };
    let mut r = 0;
    while r < rows {
        let step = if rows - r >= R { R } else { 1 };
        let (from, to) = span(&ranges[r..r + step]);
        if from < to {
            let (o, w) = (&mut out[r * hd..(r + step) * hd], &weights[r * CHUNK..(r + step) * CHUNK]);
            match (step == R, hd.is_multiple_of(W), hd.is_multiple_of(16), hd.is_multiple_of(8)) {
                (true, true, ..) => accumulate::<R, W>(o, w, values, from, to),
                (true, false, true, _) => accumulate::<R, 16>(o, w, values, from, to),
                (true, false, false, true) => accumulate::<R, 8>(o, w, values, from, to),
                (true, ..) => accumulate::<R, 1>(o, w, values, from, to),
                (false, ..) if hd.is_multiple_of(W1) => accumulate::<1, W1>(o, w, values, from, to),
                (false, true, ..) => accumulate::<1, W>(o, w, values, from, to),
                (false, false, true, _) => accumulate::<1, 16>(o, w, values, from, to),
                (false, false, false, true) => accumulate::<1, 8>(o, w, values, from, to),
                (false, ..) => accumulate::<1, 1>(o, w, values, from, to),
            }
        }
        r += step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows blocked together or one by one, and any width of register slice, give the same bits: what lets each
    /// level choose its own blocking.
    #[test]
    fn blocking_changes_no_bit() {
        let hd = 48;
        let rows = 7;
        let noise = |n: usize, salt: u32| -> Vec<f32> { (0..n as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ salt) % 2001) as f32 / 1000.0 - 1.0).collect() };
        let blocks: Vec<Vec<f32>> = (0..CHUNK_BLOCKS).map(|b| noise(BLOCK * hd, b as u32)).collect();
        let values: [&[f32]; CHUNK_BLOCKS] = std::array::from_fn(|b| &blocks[b][..]);
        let ranges: Vec<(usize, usize)> = (0..rows).map(|r| (r, CHUNK - 2 * r)).collect();
        // Weights 0 outside each row's range, as `softmax_step` leaves them.
        let mut weights = noise(rows * CHUNK, 99);
        for (r, &(from, to)) in ranges.iter().enumerate() {
            weights[r * CHUNK..(r + 1) * CHUNK].iter_mut().enumerate().filter(|(p, _)| *p < from || *p >= to).for_each(|(_, w)| *w = 0.0);
        }
        let start = noise(rows * hd, 7);
        let run = |f: &dyn Fn(&mut [f32])| {
            let mut out = start.clone();
            f(&mut out);
            out
        };
        // Each element summed in position order, `fma(w[p], v[p], o)`, written out plainly.
        let reference = run(&|o| {
            for (r, &(from, to)) in ranges.iter().enumerate() {
                for p in from..to {
                    for j in 0..hd {
                        o[r * hd + j] = weights[r * CHUNK + p].mul_add(values[p / BLOCK][(p % BLOCK) * hd + j], o[r * hd + j]);
                    }
                }
            }
        });
        assert_eq!(run(&|o| accumulate_rows::<1, 1, 1>(o, &weights, &values, &ranges, hd)), reference);
        assert_eq!(run(&|o| accumulate_rows::<4, 16, 48>(o, &weights, &values, &ranges, hd)), reference);
        assert_eq!(run(&|o| accumulate_rows::<2, 48, 16>(o, &weights, &values, &ranges, hd)), reference);
        assert_eq!(run(&|o| accumulate_rows::<3, 64, 24>(o, &weights, &values, &ranges, hd)), reference);
        let keys = noise(hd * BLOCK, 3);
        // Scores as a row's dot products, each `fma(q[d], k[d], s)` over the dimensions in order.
        let direct = |q: &[f32], c: usize| (0..hd).fold(0f32, |s, d| q[d].mul_add(keys[d * BLOCK + c], s));
        let tile = |q: &[f32], n: usize| {
            let starts: Vec<usize> = (0..n).map(|i| i * hd).collect();
            let mut t = vec![0f32; n * hd];
            transpose(q, &starts, hd, &mut t);
            t
        };
        let q = noise(4 * hd, 5);
        let mut one = vec![0f32; 4 * CHUNK];
        let mut four = vec![0f32; 4 * CHUNK];
        for i in 0..4 {
            scores::<1>(&mut one[i * CHUNK..], tile(&q[i * hd..], 1).as_chunks().0, &keys, 1, [Ahead::NONE; 2]);
            for c in 0..BLOCK {
                assert_eq!(one[i * CHUNK + BLOCK + c].to_bits(), direct(&q[i * hd..], c).to_bits());
            }
        }
        scores::<4>(&mut four, tile(&q, 4).as_chunks().0, &keys, 1, [Ahead::NONE; 2]);
        assert_eq!(one, four);
        let mut six = vec![0f32; 6 * CHUNK];
        let q = noise(6 * hd, 13);
        scores::<6>(&mut six, tile(&q, 6).as_chunks().0, &keys, 2, [Ahead::NONE; 2]);
        for i in 0..6 {
            scores::<1>(&mut one[..CHUNK], tile(&q[i * hd..], 1).as_chunks().0, &keys, 2, [Ahead::NONE; 2]);
            assert_eq!(one[2 * BLOCK..3 * BLOCK], six[i * CHUNK + 2 * BLOCK..][..BLOCK]);
        }
    }

    /// Rows' softmax steps taken together (their corrections side by side) give each row's own step's bits: 11 rows
    /// (a group of 8 and a part), whole, partial and unseen chunks, fresh and running maxima, plain and soft-capped.
    #[test]
    fn rows_together_give_each_rows_step() {
        let hd = 24;
        let noise = |n: usize, salt: u32, span: f32| -> Vec<f32> { (0..n as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ salt) % 2001) as f32 / 1000.0 * span - span).collect() };
        let ranges: Vec<(usize, usize)> = vec![(0, CHUNK), (0, 40), (7, CHUNK), (5, 5), (0, CHUNK), (3, 17), (0, 1), (0, CHUNK), (9, 2), (0, CHUNK), (63, 64)];
        let n = ranges.len();
        for scoring in [Scoring { scale: 0.125, softcap: None }, Scoring { scale: 0.0625, softcap: Some(30.0) }] {
            let scores = noise(n * CHUNK, 3, 40.0);
            let running: Vec<f32> = (0..n).map(|r| [f32::NEG_INFINITY, -2.0, 0.5, 9.0][r % 4]).collect();
            let sums: Vec<f32> = (0..n).map(|r| if r % 4 == 0 { 0.0 } else { 1.25 + r as f32 }).collect();
            let out = noise(n * hd, 11, 1.0);
            let (mut w1, mut m1, mut s1, mut o1) = (scores.clone(), running.clone(), sums.clone(), out.clone());
            for (r, &(from, to)) in ranges.iter().enumerate() {
                let row: &mut [f32; CHUNK] = (&mut w1[r * CHUNK..(r + 1) * CHUNK]).try_into().unwrap();
                softmax_step(row, from, to, scoring, &mut m1[r], &mut s1[r], &mut o1[r * hd..(r + 1) * hd]);
            }
            let (mut w2, mut m2, mut s2, mut o2) = (scores, running, sums, out);
            softmax_rows(&mut w2, &ranges, scoring, &mut m2, &mut s2, &mut o2, hd);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&w1), bits(&w2), "weights, {scoring:?}");
            assert_eq!((bits(&m1), bits(&s1)), (bits(&m2), bits(&s2)), "maxima and sums, {scoring:?}");
            assert_eq!(bits(&o1), bits(&o2), "outputs, {scoring:?}");
            // The weights are a softmax's: 0 outside each row's range, positive inside.
            for (r, &(from, to)) in ranges.iter().enumerate() {
                assert!(w2[r * CHUNK..(r + 1) * CHUNK].iter().enumerate().all(|(c, &w)| if c >= from && c < to { w > 0.0 } else { w == 0.0 }), "row {r}");
            }
        }
    }

    /// A chunk a row sees whole takes the unmasked path: the masked path's bits (written out here as it was
    /// before the split) for the weights, the maximum, the sum and the rescaled output, from a fresh row and from
    /// one whose running maximum is above, below or at the chunk's, plainly scaled and soft-capped. And a range
    /// short of the chunk still gives its masked bits.
    #[test]
    fn a_whole_chunk_gives_the_masked_steps_bits() {
        fn masked(row: &mut [f32; CHUNK], from: usize, to: usize, scoring: Scoring, max: &mut f32, sum: &mut f32, out: &mut [f32]) {
            let scale = match scoring.softcap {
                Some(cap) => {
                    row[from..to].iter_mut().for_each(|x| *x = cap * (*x * scoring.scale / cap).tanh());
                    1.0
                }
                None => scoring.scale,
            };
            let mut seen = *row;
            for (c, v) in seen.iter_mut().enumerate() {
                if c < from || c >= to {
                    *v = f32::NEG_INFINITY;
                }
            }
            let new_max = max.max(tree(seen, |a, b| if a > b { a } else { b }) * scale);
            let correction = exp(*max - new_max);
            if correction != 1.0 {
                out.iter_mut().for_each(|x| *x *= correction);
            }
            for (c, x) in row.iter_mut().enumerate() {
                let p = exp(*x * scale - new_max);
                *x = if c >= from && c < to { p } else { 0.0 };
            }
            *sum = *sum * correction + tree(*row, |a, b| a + b);
            *max = new_max;
        }
        let noise = |salt: u32, span: f32| -> [f32; CHUNK] { std::array::from_fn(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ salt) % 2001) as f32 / 1000.0 * span - span) };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for scoring in [Scoring { scale: 0.125, softcap: None }, Scoring { scale: 0.0625, softcap: Some(50.0) }] {
            for (salt, span) in [(1, 8.0), (2, 80.0), (3, 0.5)] {
                for running in [f32::NEG_INFINITY, -3.0, 0.25, 40.0] {
                    for (from, to) in [(0, CHUNK), (0, CHUNK - 1), (5, CHUNK), (3, 17)] {
                        let scores = noise(salt, span);
                        let out0: Vec<f32> = noise(salt + 7, 1.0)[..48].to_vec();
                        let (mut a, mut b) = (scores, scores);
                        let (mut max_a, mut max_b, mut sum_a, mut sum_b) = (running, running, 1.5f32, 1.5f32);
                        let (mut out_a, mut out_b) = (out0.clone(), out0);
                        softmax_step(&mut a, from, to, scoring, &mut max_a, &mut sum_a, &mut out_a);
                        masked(&mut b, from, to, scoring, &mut max_b, &mut sum_b, &mut out_b);
                        let case = format!("{scoring:?}, scores within {span}, running max {running}, {from}..{to}");
                        assert_eq!(bits(&a), bits(&b), "weights: {case}");
                        assert_eq!((max_a.to_bits(), sum_a.to_bits()), (max_b.to_bits(), sum_b.to_bits()), "max and sum: {case}");
                        assert_eq!(bits(&out_a), bits(&out_b), "output: {case}");
                    }
                }
            }
        }
    }
}
