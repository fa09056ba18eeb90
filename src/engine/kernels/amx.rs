//! The AMX level: the quantized products on Intel's tile unit (Sapphire Rapids and later), the same bits as every
//! other level.
//!
//! A tile product multiplies 16 activation rows of signed 8-bit codes (a tile `A`, row-major, read straight from
//! the activations) by 16 weight rows of codes (a tile `B`, four codes of each weight row to a 32-bit lane: two of
//! the packer's eight-row panels side by side) and adds the exact 32-bit integer sums into a 16 x 16 tile `C`:
//! `tdpbsud` for the unsigned codes of Q4_1 and the `U8` types, `tdpbssd` for the signed ones of Q8_0 and
//! Q5_0 (the packer stores them offset by 128 for VNNI's unsigned-by-signed products; the pair flips them back,
//! so the sums need no correction) and of Q4_0 (the pair takes 8 off its codes, which the VNNI kernels take off
//! their sums as `8 x` the activations' code sum). One product covers one block of 32 (Q4_0, Q4_1, Q8_0, Q5_0) or one group
//! of 16 (the `U8` types), so `C` holds exactly the integer sums the VNNI kernels compute; the float steps after them
//! (`acc = fma(sum, d_w * d_x, acc)`, then the offset's `fma`) run in AVX-512 registers in the same order, so the
//! results are bit-identical to the other levels'.
//!
//! Only whole tiles go through the tile unit: activation rows in sixteens and weight panels in pairs. The rows and
//! the panel left over (and float weights, and products of fewer than 16 rows) take the VNNI kernels, whose results
//! are the same bits.
//!
//! Per step (block, or group), up to 2 x 2 tile products (32 activation rows by 32 weight rows: each tile load
//! serves two products), each followed by the float steps of the same product one step before, so that the tile
//! unit works while the vector units finish ([`macro_tile`]). The activations come in the tile unit's order,
//! arranged once per product (`Acts::tiles`: 512 contiguous bytes per tile and block, the scales by block then
//! row), and a task's weight panels are interleaved in pairs as it reaches them ([`Pair::fill`]).
//!
//! Speed: the tile unit's sums must leave it once per block of 32 (the per-block scales forbid accumulating
//! across blocks in integers), one 1 KiB store per 16 x 16 products, and the float steps after it and their
//! accumulators' loads and stores cost about what VNNI's whole product costs (perf: most of the kernel's samples
//! wait on the tiles' stores). On a 2-core Sapphire Rapids VM, 2 threads: 1.1-1.4x VNNI on the feed-forward and
//! output matrices from 32 rows, 0.6-0.9x on the narrow k and v projections and below 32 rows; a prefill-heavy job
//! 1.06-1.10x (BENCHMARKS.md). So `auto` settles at VNNI and hands only a model's quantized products of 32 rows or
//! more (16 where the product's matrices hold 8 M weights or more) in the 4-bit and signed layouts to these tiles
//! (`super::model_level`: the same bits, 2-7 % faster whole jobs); `runtime.cpu_kernels = "amx"` runs this whole
//! level.
//!
//! Q3_K, Q4_K, Q5_K and Q6_K (`Data::K3`, `Data::K4`, `Data::K5`, `Data::Q6`) are computed per 256 ([`run_supers`]), on activations
//! quantized per 256: each weight's `sc * q` (Q6_K: `sc * (q - 32)`) is split exactly into two bytes, high and low
//! ([`SuperPair`]), and two tile products per 64 columns (the tiles' whole depth) sum a 256's `C_hi` and `C_lo` in
//! the tile registers, stored once per 256: `2^s C_hi + C_lo` is the VNNI kernels' exact integer, and the float
//! steps run once per 256, not per block. This is what lifts the tiles past the per-block bound above: on the
//! same VM, at 128 rows, 2.5-2.9x VNNI's speed on Llama-3.2-1B's Q4_K matrices, 2.4-2.65x on its Q5_K ones,
//! 2.3-4.1x on its Q6_K ones (the narrow k and v projections, measured alone, at the low end: 1.75-2.45x), 3.8-4.5x
//! on its Q3_K ones (Q3_K, `Data::K3`, takes Q6_K's tiles: [`SuperPair::fill_q6`]; BENCHMARKS.md). There the
//! vector units bound it, not the tile unit: per 256 and tile of rows the float steps take about 350 operations
//! ([`finish_super`]) while the tile unit takes about 130 cycles, so a pair of panels is laid out a slice at a
//! time in their shadow too ([`run_supers`]).
//!
//! bf16 weights take the tile unit's bf16 products (`tdpbf16ps`, AMX-BF16): there the integer detour is gone,
//! each output's sum stays in the tiles across the whole row, and a tile product does 16 times the work of the
//! int8 one per block of 32. They multiply bf16 by bf16, so the activations are rounded to bf16 first: the one
//! product whose results differ from the other levels' ([`super::amx_bf16_tiles`]; the model's
//! `weights_name` says so). Each task lays its weight rows out as tiles (pairs of columns to a 32-bit lane, a
//! 16 x 16 transpose per tile) before the activation tiles pass over them; below 8 rows that costs more than the
//! VNNI kernels' products, which take those rows on the same rounded activations. On the 2-core Sapphire Rapids
//! VM, 3.1-5.6x VNNI's speed at 128 rows, 1.8-2.6x at 16 (BENCHMARKS.md).
//!
//! F16 weights have no tile products of their own before AMX-FP16, and bf16 holds 8 of an f16's 11 significant
//! bits, so they take the bf16 products in parts: each weight is exactly `hi + lo`, two bf16 values (the top 8
//! bits, and the rest, at most 3 bits), each activation about `hi + lo` (to nearest twice: about 16 bits), and the
//! tiles sum `hi·hi + hi·lo + lo·hi` (`lo·lo`, under 2^-15 of a product, left out): each product within 2^-15 +
//! 2^-16 of the exact one (at worst; the other levels compute it exactly), where rounding the activations to bf16
//! is up to 2^-8 off and llama.cpp's rounding them to f16 up to 2^-11. Three
//! products and two weight layouts per tile: it pays from 16 rows; fewer take the VNNI kernels' exact products.
//!
//! Linux hands a process the tiles' 8 KiB register state only when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! until then the first tile instruction is `SIGILL`. [`granted`] asks once and the level exists only if Linux
//! says yes.

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

use super::{Acts, Data, Out, Packed, PANEL};

/// Activation rows per tile.
const ROWS: usize = 16;
/// Weight rows per tile: two panels.
const COLS: usize = 2 * PANEL;
/// Activation rows whose codes stay in the L2 cache while a task's weights pass over them.
const ROW_GROUP: usize = 256;
/// The most activation codes a group of rows of [`run_supers`] holds: half the L2 cache of a Sapphire Rapids core,
/// which keeps a group's codes there while every pair of panels passes over them (2 MiB, 256 rows at k = 8,192,
/// took 10-15 % longer per tile product than 1 MiB: a probe of the tile loop alone, and `bench kernels`).
const GROUP_BYTES: usize = 1 << 20;

/// Whether the AMX level runs here: the CPU has the tile unit with int8 products, AVX-512 (F, BW, VL, VNNI: the
/// float steps and the tails), and Linux grants this process the tile state. Asked once per process; the
/// permission is the whole process's, whatever thread asks.
pub(super) fn granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        if !cpu_has_amx() {
            return false;
        }
        match request_tiles() {
            Ok(()) => true,
            Err(e) => {
                tracing::info!(error = %e, "the CPU has AMX but Linux does not grant it to this process: the kernels run at the VNNI level");
                false
            }
        }
    })
}

/// Whether the tile unit's bf16 products run here too: the AMX level ([`granted`]) on a CPU with AMX-BF16 (CPUID
/// leaf 7, sub-leaf 0, EDX bit 22; every CPU with AMX-INT8 so far).
pub(super) fn bf16_granted() -> bool {
    // Asked once: `cpuid` leaves a virtual machine for its host, tens of microseconds.
    static BF16: OnceLock<bool> = OnceLock::new();
    *BF16.get_or_init(|| granted() && __cpuid_count(7, 0).edx & (1 << 22) != 0)
}

fn cpu_has_amx() -> bool {
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    // CPUID leaf 7, sub-leaf 0 (present on every CPU with AVX-512, checked first): EDX bit 24 AMX-TILE, bit 25
    // AMX-INT8.
    avx512 && {
        let leaf = __cpuid_count(7, 0);
        leaf.edx & (1 << 24) != 0 && leaf.edx & (1 << 25) != 0
    }
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: Linux's permission for the tiles' register state.
#[cfg(target_os = "linux")]
fn request_tiles() -> std::io::Result<()> {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: `arch_prctl` with these arguments reads nothing from our memory and only changes which register
    // state the kernel saves for this process; it fails cleanly (EINVAL, ENOSPC) where it cannot grant it.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tiles() -> std::io::Result<()> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "AMX is asked for only on Linux"))
}

/// The tile configuration (`ldtilecfg`'s 64 bytes): palette 1; `tmm0..tmm3` the 16 x 16 integer sums; `tmm4`,
/// `tmm5` activation tiles of 16 rows by `width` codes; `tmm6`, `tmm7` weight tiles of `width / 4` rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn new(width: usize) -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut tile = |t: usize, rows: usize, bytes: usize| {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(bytes as u16).to_le_bytes());
            c[48 + t] = rows as u8;
        };
        for t in 0..4 {
            tile(t, ROWS, 64);
        }
        for t in [4, 5] {
            tile(t, ROWS, width);
            tile(t + 2, width / 4, 64);
        }
        Config(c)
    }
}

/// 64 bytes, aligned as the tile loads and stores like them.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A pair of panels in the tile unit's layout, for every block: per block (or group), the weight tile's rows and
/// the sixteen weight rows' scales and offsets.
struct Pair {
    /// `[block, 8 lines]`: line `j` of block `b` holds, for each of the 16 weight rows, its four codes
    /// `4j..4j + 4` of the block (of the group `j / 4` for `U8`, whose tiles are lines `0..4` and `4..8`; signed
    /// for `S8`, unsigned otherwise).
    codes: Vec<Line>,
    /// `[block, group, 16]`: scales and offsets (groups: 1 per block, 2 for `U8`).
    d: Vec<f32>,
    m: Vec<f32>,
}

impl Pair {
    fn new(blocks: usize, groups: usize) -> Pair {
        Pair { codes: vec![Line([0; 64]); 8 * blocks], d: vec![0.0; 16 * groups * blocks], m: vec![0.0; 16 * groups * blocks] }
    }

    /// Panels `p` and `p + 1` of `w` (both exist).
    #[target_feature(enable = "avx2")]
    fn fill(&mut self, w: &Packed, p: usize) {
        let blocks = w.k / 32;
        let halves = |line: &mut Line, a: &[u8], b: &[u8]| {
            line.0[..32].copy_from_slice(a);
            line.0[32..].copy_from_slice(b);
        };
        let two = |out: &mut [f32], v: &[f32], at: [usize; 2]| {
            out[..8].copy_from_slice(&v[at[0]..at[0] + 8]);
            out[8..16].copy_from_slice(&v[at[1]..at[1] + 8]);
        };
        // The file's f16 scales (`Q4`, `S8`) as f32.
        let halves16 = |out: &mut [f32], v: &[u16], at: [usize; 2]| {
            for (i, out) in out[..16].iter_mut().enumerate() {
                *out = super::half_f32(v[at[i / 8] + i % 8]);
            }
        };
        match &w.data {
            Data::Q4 { qs, d, m } => {
                // Q4_0 (no offsets): the codes less 8, signed, for `tdpbssd`.
                let less = _mm256_set1_epi8(if m.is_empty() { 8 } else { 0 });
                for b in 0..blocks {
                    let lines = &mut self.codes[8 * b..8 * b + 8];
                    let mask = _mm256_set1_epi8(0x0F);
                    for s in 0..2 {
                        let panel = &qs[((p + s) * blocks + b) * 128..][..128];
                        for t in 0..4 {
                            // SAFETY: 32 bytes at `32 t` of the panel's 128, and at `32 s` of lines `t` and `4 + t`'s
                            // 64.
                            unsafe {
                                let raw = _mm256_loadu_si256(panel.as_ptr().add(32 * t).cast());
                                let (lo, hi) = (_mm256_and_si256(raw, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask));
                                _mm256_storeu_si256(lines[t].0.as_mut_ptr().add(32 * s).cast(), _mm256_sub_epi8(lo, less));
                                _mm256_storeu_si256(lines[4 + t].0.as_mut_ptr().add(32 * s).cast(), _mm256_sub_epi8(hi, less));
                            }
                        }
                    }
                    let at = [(p * blocks + b) * PANEL, ((p + 1) * blocks + b) * PANEL];
                    halves16(&mut self.d[16 * b..16 * b + 16], d, at);
                    if !m.is_empty() {
                        halves16(&mut self.m[16 * b..16 * b + 16], m, at);
                    }
                }
            }
            Data::U8 { qs, .. } | Data::S8 { qs, .. } => {
                // S8: the signed codes back as they are copied (stored offset by 128 for VNNI's unsigned-by-signed
                // products): the tiles multiply signed by signed (`tdpbssd`), and the sums need no correction.
                let flip = if matches!(w.data, Data::S8 { .. }) { 0x80 } else { 0 };
                for b in 0..blocks {
                    let at = [(p * blocks + b) * 256, ((p + 1) * blocks + b) * 256];
                    for g in 0..8 {
                        let line = &mut self.codes[8 * b + g];
                        halves(line, &qs[at[0] + 32 * g..at[0] + 32 * g + 32], &qs[at[1] + 32 * g..at[1] + 32 * g + 32]);
                        if flip != 0 {
                            line.0.iter_mut().for_each(|c| *c ^= flip);
                        }
                    }
                }
                match &w.data {
                    Data::U8 { d, m, .. } => {
                        for bh in 0..2 * blocks {
                            let at = [((p * blocks) * 2 + bh) * PANEL, (((p + 1) * blocks) * 2 + bh) * PANEL];
                            two(&mut self.d[16 * bh..16 * bh + 16], d, at);
                            two(&mut self.m[16 * bh..16 * bh + 16], m, at);
                        }
                    }
                    Data::S8 { d, .. } => {
                        for b in 0..blocks {
                            halves16(&mut self.d[16 * b..16 * b + 16], d, [(p * blocks + b) * PANEL, ((p + 1) * blocks + b) * PANEL]);
                        }
                    }
                    _ => unreachable!(),
                }
            }
            Data::Q6 { .. } | Data::Q6N { .. } | Data::K3 { .. } | Data::K4 { .. } | Data::K5 { .. } | Data::K5N { .. } => unreachable!("per-256 layouts fill a SuperPair"),
            Data::U5 { .. } | Data::S5 { .. } => unreachable!("Q5_1's and Q5_0's narrow layouts take the VNNI kernels (`run`)"),
            Data::F16(_) | Data::Bf16(_) => unreachable!("float weights do not take the tile unit"),
        }
    }
}

/// A 16 x 16 tile in memory, row `i` activation row `i`'s values for the 16 weight rows: one tile product's
/// integer sums, or outputs.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Tile<T: Copy>([[T; COLS]; ROWS]);

/// Loads tile register `tmm{R}` (4, 5: activations; 6, 7: weights) with rows at `stride` bytes from `p`.
///
/// Safety: the tiles are configured ([`Config`]); the configured rows of tile `R` at `stride` from `p` lie inside
/// one buffer.
#[inline(always)]
unsafe fn load<const R: u8>(p: *const u8, stride: usize) {
    // SAFETY: the caller's contract. (The tile registers keep their values from one `asm!` to the next: nothing else
    // in this program touches them.)
    unsafe {
        match R {
            4 => asm!("tileloadd tmm4, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
            5 => asm!("tileloadd tmm5, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
            6 => asm!("tileloadd tmm6, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
            _ => asm!("tileloadd tmm7, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly)),
        }
    }
}

/// One tile product of a step: `C[c] = A[c / 2] · B[c % 2]` (activations `tmm4`/`tmm5`, weights `tmm6`/`tmm7`, as
/// loaded by [`load`]) into sums `tmm{c}`, stored to `out` (1 KiB). `signed`: signed weight codes (`tdpbssd`),
/// else unsigned (`tdpbsud`); the activation codes are signed. (Callers pass a constant: the branch folds away.)
///
/// Safety: the tiles are configured and `tmm4 + c / 2`, `tmm6 + c % 2` loaded; `out` is valid for 1 KiB.
#[inline(always)]
unsafe fn product<const C: u8>(signed: bool, out: *mut Tile<i32>) {
    macro_rules! one {
        ($c:literal, $op:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tilezero tmm", $c),
                concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $b),
                concat!("tilestored [{o} + {l}*1], tmm", $c),
                o = in(reg) out, l = in(reg) 64usize, options(nostack),
            )
        };
    }
    // SAFETY: the caller's contract; the store writes the 1 KiB at `out`.
    unsafe {
        match (C, signed) {
            (0, false) => one!("0", "tdpbsud", "4", "6"),
            (1, false) => one!("1", "tdpbsud", "4", "7"),
            (2, false) => one!("2", "tdpbsud", "5", "6"),
            (3, false) => one!("3", "tdpbsud", "5", "7"),
            (0, true) => one!("0", "tdpbssd", "4", "6"),
            (1, true) => one!("1", "tdpbssd", "4", "7"),
            (2, true) => one!("2", "tdpbssd", "5", "6"),
            _ => one!("3", "tdpbssd", "5", "7"),
        }
    }
}

/// The layouts' kinds, as the tile functions' const parameter: 4-bit codes with offsets (per 32), 8-bit codes
/// with offsets (per 16), signed 8-bit codes stored offset by 128 (per 32), 4-bit codes standing for `code - 8`
/// (Q4_0, per 32; paired signed, as `S8`'s are).
const Q4: u8 = 0;
const U8: u8 = 1;
const S8: u8 = 2;
const Q4S: u8 = 3;
/// The per-256 layouts ([`run_supers`]): Q6_K's, its weights' high parts signed, Q4_K's and Q5_K's.
const Q6: u8 = 4;
const K4: u8 = 5;
const K5: u8 = 6;

/// Whether kind `T` has mins (`K4`, `K5`).
const fn with_mins(t: u8) -> bool {
    t == K4 || t == K5
}

/// Whether kind `T`'s tiles hold signed codes (`tdpbssd`) and its float steps have no offset.
const fn signed(t: u8) -> bool {
    t == S8 || t == Q4S
}

/// The AMX level's kernels, for weight rows `rows` (whole panels) times every activation row: [`run`], once
/// [`granted`] says it may.
pub(super) fn run_checked(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    assert!(granted(), "AMX kernels where AMX is not granted (a bug)");
    // SAFETY: `granted` checked the CPU has every feature the AMX kernels use and Linux granted the tiles.
    unsafe { run(w, rows, x, out) }
}

/// Weight rows `rows` (whole panels) times every activation row.
///
/// Safety: the CPU has AVX-512 F, BW, VL and VNNI, AVX2, FMA and F16C, and Linux has granted the tiles ([`granted`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let (tiles, pairs) = (x.rows() / ROWS, (rows.end.div_ceil(PANEL) - rows.start / PANEL) / 2);
    match w.data {
        // Padded tiles: any rows and weight rows.
        Data::Bf16(ref bits) if !x.bf16.is_empty() => run_float::<false>(bits, w, rows, x, out),
        Data::F16(ref bits) if !x.bf16.is_empty() => run_float::<true>(bits, w, rows, x, out),
        _ if tiles == 0 || pairs == 0 => super::x86::avx512_vnni::run(w, rows, x, out),
        Data::Q4 { .. } if w.signed4() => run_tiles::<Q4S>(w, rows, x, out),
        Data::Q4 { .. } => run_tiles::<Q4>(w, rows, x, out),
        Data::U8 { .. } => run_tiles::<U8>(w, rows, x, out),
        Data::S8 { .. } => run_tiles::<S8>(w, rows, x, out),
        // Q3_K's tiles are Q6_K's (`SuperPair::fill_q6`).
        Data::Q6 { .. } | Data::K3 { .. } => run_supers::<Q6>(w, rows, x, out),
        // Q6_K, Q5_K, Q5_1 and Q5_0 in their narrow layouts are held only where the process does not take the tiles
        // (`pack::narrow_codes`); a level forced here anyway computes them with the VNNI kernels, the same bits.
        Data::Q6N { .. } | Data::K5N { .. } | Data::U5 { .. } | Data::S5 { .. } => super::x86::avx512_vnni::run(w, rows, x, out),
        Data::K4 { .. } => run_supers::<K4>(w, rows, x, out),
        Data::K5 { .. } => run_supers::<K5>(w, rows, x, out),
        // bf16 products of fewer than `BF16_TILE_ROWS` rows (their activations rounded to bf16 all the same, see
        // `matmul_many`), and F16 products of fewer than `F16_TILE_ROWS` (exact, as at the other levels).
        Data::F16(_) | Data::Bf16(_) => super::x86::avx512_vnni::run(w, rows, x, out),
    }
}

/// Weight rows `n0..n0 + 16` of a bf16 matrix (those below `end`; zero past it and past column `k`) as the tile
/// unit's weight tiles, one per step of 32 columns: line `r` of step `s` holds, for each of the 16 rows, its
/// columns `32 s + 2 r` and `32 s + 2 r + 1`, lower first.
#[target_feature(enable = "avx512f")]
fn bf16_pair(bits: &[u16], k: usize, n0: usize, end: usize, lines: &mut [Line]) {
    let rows = 16.min(end.saturating_sub(n0));
    if rows == 16 && k.is_multiple_of(32) {
        assert!((n0 + 16) * k <= bits.len() && lines.len() == k / 2, "bf16 weight tiles out of range (a bug)");
        for s in 0..k / 32 {
            // SAFETY: this function has AVX-512 F; rows `n0..n0 + 16`, columns `32 s..32 s + 32` lie in `bits` and
            // lines `16 s..16 s + 16` in `lines` (asserted above).
            unsafe { transpose16(bits.as_ptr().add(n0 * k + 32 * s), k, lines.as_mut_ptr().add(16 * s)) };
        }
        return;
    }
    if rows < 16 || !k.is_multiple_of(32) {
        lines.fill(Line([0; 64]));
    }
    for c in 0..rows {
        let row = &bits[(n0 + c) * k..(n0 + c + 1) * k];
        // Each pair of columns as one 32-bit lane, the lower column in the low half.
        for (p, pair) in row.chunks(2).enumerate() {
            let lane = u32::from(pair[0]) | pair.get(1).map_or(0, |&v| u32::from(v) << 16);
            let line = &mut lines[p / 16 * 16 + p % 16];
            line.0[4 * c..4 * c + 4].copy_from_slice(&lane.to_le_bytes());
        }
    }
}

/// The 16 x 16 transpose of 32-bit lanes that lays out one weight tile: row `c` (at `c * k` values of 16 bits
/// from `w`) holds 16 lanes of two columns each; line `j` of `out` gets lane `j` of every row, row `c`'s at lane
/// `c`. Three rounds of shuffles: 32-bit and 64-bit interleaves within each 128-bit lane (four rows' lanes `4L +
/// e` side by side), then 128-bit lanes across registers.
///
/// Safety: the CPU has AVX-512 F; 16 rows of 64 bytes at `w + c k` (16-bit units) and 16 lines at `out` are valid.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(w: *const u16, k: usize, out: *mut Line) {
    // SAFETY (the loads and stores): the caller's contract.
    let r: [__m512i; 16] = std::array::from_fn(|c| unsafe { _mm512_loadu_si512(w.add(c * k).cast()) });
    // Per 128-bit lane L: t[4g] = [a0 b0 a1 b1], t[4g + 1] = [a2 b2 a3 b3], t[4g + 2] = [c0 d0 c1 d1], t[4g + 3] =
    // [c2 d2 c3 d3] for rows a..d = 4g..4g + 4 (element e standing for the row's lane 4L + e).
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, q) = (i / 4, i % 4);
        let (a, b) = (r[4 * g + 2 * (q / 2)], r[4 * g + 2 * (q / 2) + 1]);
        if q % 2 == 0 { _mm512_unpacklo_epi32(a, b) } else { _mm512_unpackhi_epi32(a, b) }
    });
    // u[4g + e] = [a_e b_e c_e d_e] per lane.
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (g, e) = (i / 4, i % 4);
        let (x, y) = (t[4 * g + e / 2], t[4 * g + e / 2 + 2]);
        if e % 2 == 0 { _mm512_unpacklo_epi64(x, y) } else { _mm512_unpackhi_epi64(x, y) }
    });
    for e in 0..4 {
        let v0 = _mm512_shuffle_i32x4::<0x44>(u[e], u[4 + e]);
        let v1 = _mm512_shuffle_i32x4::<0xEE>(u[e], u[4 + e]);
        let v2 = _mm512_shuffle_i32x4::<0x44>(u[8 + e], u[12 + e]);
        let v3 = _mm512_shuffle_i32x4::<0xEE>(u[8 + e], u[12 + e]);
        let lanes = [_mm512_shuffle_i32x4::<0x88>(v0, v2), _mm512_shuffle_i32x4::<0xDD>(v0, v2), _mm512_shuffle_i32x4::<0x88>(v1, v3), _mm512_shuffle_i32x4::<0xDD>(v1, v3)];
        for (l, v) in lanes.into_iter().enumerate() {
            // SAFETY: line `4 l + e` < 16 (the caller's contract).
            unsafe { _mm512_storeu_si512(out.add(4 * l + e).cast(), v) };
        }
    }
}

/// 2 x 2 bf16 tile products over `steps` steps of 32 columns per segment, summed in the tiles over every segment:
/// `C[2a + b] = Σ_segments Σ_s A[a]_s · B[b]_s` for activation tiles from a segment's `x[a]` and weight tiles from
/// its `w[b]` (1 KiB each, the next step's 1 KiB further on), stored to `c[0..4]`. Tiles: sums `tmm0..tmm3`,
/// activations `tmm4`, `tmm5`, weights `tmm6`, `tmm7`. (The tile registers keep their values from one `asm!` to the
/// next: nothing else in this program touches them.)
///
/// Safety: the tiles are configured for 16 rows of 64 bytes (`Config::new(64)`), `steps >= 1`, and each segment's
/// `x[a]`, `w[b]` each point at `steps` KiB.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bf16_products(segments: &[([*const u16; 2], [*const Line; 2])], steps: usize, c: &mut [Tile<f32>; 4]) {
    // SAFETY: no memory operands.
    unsafe { asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem)) };
    for &(x, w) in segments {
        // SAFETY: the caller's contract for the loads.
        unsafe {
            asm!(
                "2:",
                "tileloadd tmm4, [{x0} + {line}*1]",
                "tileloadd tmm6, [{w0} + {line}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{w1} + {line}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{x1} + {line}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {x0}, 1024", "add {x1}, 1024", "add {w0}, 1024", "add {w1}, 1024",
                "dec {n}",
                "jnz 2b",
                x0 = inout(reg) x[0] => _, x1 = inout(reg) x[1] => _, w0 = inout(reg) w[0] => _, w1 = inout(reg) w[1] => _,
                n = inout(reg) steps => _, line = in(reg) 64usize, options(nostack, readonly),
            );
        }
    }
    let c = c.as_mut_ptr();
    // SAFETY: the stores write tiles `c[0..4]`, 1 KiB each, 4 KiB in all.
    unsafe {
        asm!(
            "tilestored [{c} + {line}*1], tmm0",
            "tilestored [{c} + {line}*1 + 1024], tmm1",
            "tilestored [{c} + {line}*1 + 2048], tmm2",
            "tilestored [{c} + {line}*1 + 3072], tmm3",
            line = in(reg) 64usize, c = in(reg) c, options(nostack),
        );
    }
}

/// Weight rows `n0..n0 + 16` of an F16 matrix (those below `end`; zero past it and past column `k`) as two sets of
/// bf16 weight tiles, [`bf16_pair`]'s layout: `lines[..k / 2]` (rounded up to whole steps) the high parts, the rest
/// the low parts. Each weight `w` splits exactly: `hi` its top 8 significant bits (truncated), `lo = w - hi`, at
/// most 3 significant bits (f16 has 11), so `hi + lo = w` (a non-finite weight's `lo` is zero).
#[target_feature(enable = "avx512f,avx512bw")]
fn f16_pair(bits: &[u16], k: usize, n0: usize, end: usize, lines: &mut [Line]) {
    let (rows, steps) = (16.min(end.saturating_sub(n0)), k.div_ceil(32));
    assert!(lines.len() == 32 * steps && (n0 + rows) * k <= bits.len(), "F16 weight tiles out of range (a bug)");
    let (hi_lines, lo_lines) = lines.split_at_mut(16 * steps);
    let mut hi = [0u16; 16 * 32];
    let mut lo = [0u16; 16 * 32];
    for s in 0..steps {
        let width = 32.min(k - 32 * s);
        if rows < 16 || width < 32 {
            hi.fill(0);
            lo.fill(0);
        }
        for c in 0..rows {
            let row = &bits[(n0 + c) * k + 32 * s..][..width];
            split_f16(row, &mut hi[32 * c..32 * c + width], &mut lo[32 * c..32 * c + width]);
        }
        // SAFETY: this function has AVX-512 F; `hi` and `lo` are 16 rows of 32 values (`k` = 32 for the transpose),
        // and lines `16 s..16 s + 16` lie in each half of `lines` (asserted above).
        unsafe {
            transpose16(hi.as_ptr(), 32, hi_lines.as_mut_ptr().add(16 * s));
            transpose16(lo.as_ptr(), 32, lo_lines.as_mut_ptr().add(16 * s));
        }
    }
}

/// F16 weights (bits) split into bf16 high and low parts, [`f16_pair`]'s split: 32 at a time in AVX-512 (widened
/// by `vcvtph2ps`, exact), the rest one by one.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn split_f16(row: &[u16], hi: &mut [u16], lo: &mut [u16]) {
    assert!(hi.len() == row.len() && lo.len() == row.len(), "F16 split lengths (a bug)");
    let whole = row.len() / 32 * 32;
    // Lane `i` of the result: 16-bit element `2 i + 1` of (a, b), the high half of 32-bit lane `i` of a then b.
    let odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    let top = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    for j in (0..whole).step_by(32) {
        // SAFETY: 32 values (64 bytes) at `j` of `row`, `hi` and `lo` (`j + 32 <= whole <= len`, equal lengths).
        unsafe {
            let v = _mm512_loadu_si512(row.as_ptr().add(j).cast());
            let f = [_mm512_cvtph_ps(_mm512_castsi512_si256(v)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v))];
            let h = f.map(|f| _mm512_and_si512(_mm512_castps_si512(f), top));
            let l = [0, 1].map(|i| {
                let rest = _mm512_sub_ps(f[i], _mm512_castsi512_ps(h[i]));
                // inf - inf: a NaN whose weight's high part is already non-finite; zero instead.
                _mm512_castps_si512(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(rest, rest), rest))
            });
            _mm512_storeu_si512(hi.as_mut_ptr().add(j).cast(), _mm512_permutex2var_epi16(h[0], odd, h[1]));
            _mm512_storeu_si512(lo.as_mut_ptr().add(j).cast(), _mm512_permutex2var_epi16(l[0], odd, l[1]));
        }
    }
    for j in whole..row.len() {
        (hi[j], lo[j]) = split_f16_one(row[j]);
    }
}

/// Activations (f32) split into bf16 high and low parts, [`super::split_bf16`]'s split (the same bits), 16 at a time
/// in AVX-512, the rest one by one.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn split_acts(values: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    assert!(hi.len() == values.len() && lo.len() == values.len(), "activation split lengths (a bug)");
    let whole = values.len() / 32 * 32;
    let odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    /// To nearest, ties to even, as `round_bf16`: `u + 0x7FFF + (bit 16 of u)`, its top half; a NaN kept a NaN
    /// (quieted: bit 22 set). (A function, not a closure: a closure does not take this function's target features,
    /// so it was not inlined, a call per vector, a third of the split's time.)
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn round(f: __m512) -> __m512i {
        let (top, half, one, quiet) = (_mm512_set1_epi32(0xFFFF_0000u32 as i32), _mm512_set1_epi32(0x7FFF), _mm512_set1_epi32(1), _mm512_set1_epi32(0x0040_0000));
        let u = _mm512_castps_si512(f);
        let up = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32::<16>(u), one)));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(f, f);
        _mm512_and_si512(_mm512_mask_mov_epi32(up, nan, _mm512_or_si512(u, quiet)), top)
    }
    for j in (0..whole).step_by(32) {
        // SAFETY: 32 values at `j` of `values` (128 bytes), `hi` and `lo` (64 bytes each): `j + 32 <= whole <= len`.
        unsafe {
            let f = [_mm512_loadu_ps(values.as_ptr().add(j)), _mm512_loadu_ps(values.as_ptr().add(j + 16))];
            let h = [round(f[0]), round(f[1])];
            let mut l = [_mm512_setzero_si512(); 2];
            for i in 0..2 {
                let rest = _mm512_sub_ps(f[i], _mm512_castsi512_ps(h[i]));
                // A non-finite value's rest (inf - inf, NaN) is zero, as `split_bf16` has it.
                let finite = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(_mm512_sub_ps(rest, rest), _mm512_sub_ps(rest, rest));
                l[i] = _mm512_maskz_mov_epi32(finite, round(rest));
            }
            _mm512_storeu_si512(hi.as_mut_ptr().add(j).cast(), _mm512_permutex2var_epi16(h[0], odd, h[1]));
            _mm512_storeu_si512(lo.as_mut_ptr().add(j).cast(), _mm512_permutex2var_epi16(l[0], odd, l[1]));
        }
    }
    for j in whole..values.len() {
        (hi[j], lo[j]) = super::split_bf16(values[j]);
    }
}

/// One F16 weight's split ([`f16_pair`]).
pub(super) fn split_f16_one(bits: u16) -> (u16, u16) {
    let f = half::f16::from_bits(bits).to_f32();
    let hi = (f.to_bits() >> 16) as u16;
    let rest = f - f32::from_bits(u32::from(hi) << 16);
    (hi, if rest.is_nan() { 0 } else { (rest.to_bits() >> 16) as u16 })
}

/// [`run`] for bf16 weights and at least [`super::BF16_TILE_ROWS`] activation rows (`SPLIT` false), or F16 weights
/// and at least [`super::F16_TILE_ROWS`] (`SPLIT`): the tile unit's bf16 products (`tdpbf16ps`: pairs of bf16
/// products, exact in f32, added to f32 sums), 32 activation rows by 32 weight rows at a time, each output's sum
/// kept in the tiles over every column. bf16: the rounded activations ([`Acts::bf16`]) by the weights as stored.
/// F16: each weight is exactly the sum of two bf16 values ([`f16_pair`]) and each activation within 2^-16 of the sum
/// of two ([`super::split_tile_order`]), and the products are high by high, high by low and low by high (low by low,
/// under 2^-15 of a product, is left out): each within 2^-15 + 2^-16 of the exact product at worst, where a bf16
/// rounding of the activations alone is up to 2^-8 off. The edges (a last tile of rows, the last weight rows) run in
/// padded tiles: zeros that add nothing.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn run_float<const SPLIT: bool>(bits: &[u16], w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let (m, k) = (x.rows(), w.k);
    let (steps, tiles) = (k.div_ceil(32), m.div_ceil(ROWS));
    // Per tile of activation rows, and per 16 weight rows, the high parts' steps and (split) the low parts'.
    let parts = if SPLIT { 2 } else { 1 };
    assert!(x.bf16.len() == tiles * parts * steps * 512 && bits.len() == w.n * k && rows.end <= w.n, "bf16 tile layout (a bug)");
    let config = Config::new(64);
    // SAFETY: `config` is a valid palette-1 configuration (every tile 16 rows of 64 bytes), 64 bytes.
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    let mut pairs = [vec![Line([0; 64]); parts * 16 * steps], vec![Line([0; 64]); parts * 16 * steps]];
    let mut c = [Tile([[0f32; COLS]; ROWS]); 4];
    let groups = (rows.end - rows.start).div_ceil(COLS);
    for q in (0..groups).step_by(2) {
        let nb = (groups - q).min(2);
        let n0 = [0, 1].map(|j| rows.start + COLS * (q + j.min(nb - 1)));
        for (j, pair) in pairs.iter_mut().enumerate().take(nb) {
            match SPLIT {
                true => f16_pair(bits, k, n0[j], rows.end, pair),
                false => bf16_pair(bits, k, n0[j], rows.end, pair),
            }
        }
        for t in (0..tiles).step_by(2) {
            let na = (tiles - t).min(2);
            let xs = [0, 1].map(|a| x.bf16[(t + a.min(na - 1)) * parts * steps * 512..].as_ptr());
            let ws = [0, 1].map(|j| pairs[j.min(nb - 1)].as_ptr());
            // The low parts, a set of steps further on.
            let low = |p: [*const u16; 2]| p.map(|p| p.wrapping_add(steps * 512));
            let low_w = |p: [*const Line; 2]| p.map(|p| p.wrapping_add(16 * steps));
            let segments = [(xs, ws), (xs, low_w(ws)), (low(xs), ws)];
            // SAFETY: configured above for 16 rows of 64 bytes; `steps >= 1` (k > 0); each activation pointer is
            // tile `t + a < tiles`'s `parts x steps` KiB of `x.bf16` (asserted length) and each weight pointer a
            // pair's `parts x 16 steps` lines, the low parts (split only) `steps` KiB into each.
            unsafe { bf16_products(&segments[..if SPLIT { 3 } else { 1 }], steps, &mut c) };
            for a in 0..na {
                for j in 0..nb {
                    for i in 0..ROWS.min(m - ROWS * (t + a)) {
                        for half in 0..2 {
                            let col = n0[j] + PANEL * half;
                            if col < rows.end {
                                let lanes: &[f32; PANEL] = c[2 * a + j].0[i][PANEL * half..PANEL * half + PANEL].try_into().expect("eight lanes");
                                out.write_lanes(ROWS * (t + a) + i, col, lanes);
                            }
                        }
                    }
                }
            }
        }
    }
    // SAFETY: no operands; the tiles return to their initial state.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// [`run`] for quantized weights of kind `T`, at least one whole tile of activation rows and one pair of panels.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn run_tiles<const T: u8>(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let m = x.rows();
    let tiles = m / ROWS;
    let (first, end) = (rows.start / PANEL, rows.end.div_ceil(PANEL));
    let pairs = (end - first) / 2;
    let groups = if T == U8 { 2 } else { 1 };
    let config = Config::new(32 / groups);
    // SAFETY: `config` is a valid palette-1 configuration (every tile at most 16 rows of 64 bytes), 64 bytes.
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    let mut pair = [Pair::new(w.k / 32, groups), Pair::new(w.k / 32, groups)];
    let mut sums = [[Tile([[0; COLS]; ROWS]); 4]; 2];
    let mut acc = [Tile([[0f32; COLS]; ROWS]); 4];
    for group in (0..tiles).step_by(ROW_GROUP / ROWS) {
        let group_end = (group + ROW_GROUP / ROWS).min(tiles);
        for q in (0..pairs).step_by(2) {
            let p = [first + 2 * q, first + 2 * q + 2];
            let nb = (pairs - q).min(2);
            for (j, pair) in pair.iter_mut().enumerate().take(nb) {
                pair.fill(w, p[j]);
            }
            for t in (group..group_end).step_by(2) {
                let r0 = ROWS * t;
                match ((group_end - t).min(2), nb) {
                    (2, 2) => macro_tile::<2, 2, T>(w, &pair, p, x, r0, &mut sums, &mut acc, out),
                    (2, _) => macro_tile::<2, 1, T>(w, &pair, p, x, r0, &mut sums, &mut acc, out),
                    (_, 2) => macro_tile::<1, 2, T>(w, &pair, p, x, r0, &mut sums, &mut acc, out),
                    _ => macro_tile::<1, 1, T>(w, &pair, p, x, r0, &mut sums, &mut acc, out),
                }
            }
        }
    }
    leftovers(w, first..end, pairs, x, out);
}

/// Releases the tiles, then hands the VNNI kernels what the tile unit leaves of panels `panels` (of which `pairs`
/// whole pairs took the tiles): the last, unpaired panel for the tiles' rows, and every panel for the rows past the
/// last whole tile (the same bits).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn leftovers(w: &Packed, panels: Range<usize>, pairs: usize, x: &Acts, out: Out) {
    // SAFETY: no operands; the tiles return to their initial state and this thread's saved state shrinks.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    let (m, tiles, pairs_end) = (x.rows(), x.rows() / ROWS, panels.start + 2 * pairs);
    // (The VNNI kernels' features are a subset of this function's.)
    if pairs_end < panels.end {
        super::x86::avx512_vnni::quantized_panel(w, pairs_end..panels.end, x, 0, ROWS * tiles, out, (&[], 0));
    }
    if ROWS * tiles < m {
        super::x86::avx512_vnni::quantized_panel(w, panels, x, ROWS * tiles, m - ROWS * tiles, out, (&[], 0));
    }
}

/// The float steps of step `s` (block `s / groups`, half `s % groups`) for one tile product's sums `c`: activation
/// rows `r0..r0 + 16` by the 16 weight rows of `pair`, per output `acc = fma(sum, d_w * d_x, acc)`, then `acc =
/// fma(m_w, s_x, acc)` where the type has offsets.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn finish<const T: u8>(acc: &mut Tile<f32>, c: &Tile<i32>, s: usize, pair: &Pair, x: &Acts, r0: usize) {
    // The first step starts from zero sums rather than `acc`'s (a buffer reused from one macro tile to the next,
    // never zeroed: zeroing 4 KiB per macro tile was 1.8 % of a prefill).
    let first = s == 0;
    let b = if T == U8 { s / 2 } else { s };
    let (m, order) = (x.rows(), &x.tiles);
    let sums = if T == U8 { &order.s16 } else { &order.s32 };
    assert!(r0 + ROWS <= m && (b + 1) * m <= order.d.len() && (s + 1) * m <= sums.len(), "scales out of range (a bug)");
    assert!(16 * (s + 1) <= pair.d.len() && pair.m.len() == pair.d.len(), "pair scales out of range (a bug)");
    // SAFETY (these pointers, and every use below): rows `r0..r0 + 16` of block `b` (step `s`) and the pair's 16
    // scales and offsets at `16 s` are in range (asserted above); the CPU has AVX-512 F (the callers' features).
    unsafe {
        let (xd, xs) = (order.d.as_ptr().add(b * m + r0), sums.as_ptr().add(s * m + r0));
        let (dw, mw) = (_mm512_loadu_ps(pair.d.as_ptr().add(16 * s)), _mm512_loadu_ps(pair.m.as_ptr().add(16 * s)));
        for i in 0..ROWS {
            // Row `i` of the tiles holds 16 values, 64-byte aligned.
            let sum = _mm512_load_si512(c.0[i].as_ptr().cast());
            let mut v = if first { _mm512_setzero_ps() } else { _mm512_load_ps(acc.0[i].as_ptr()) };
            v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(*xd.add(i))), v);
            if !signed(T) {
                v = _mm512_fmadd_ps(mw, _mm512_set1_ps(*xs.add(i)), v);
            }
            _mm512_store_ps(acc.0[i].as_mut_ptr(), v);
        }
    }
}

/// A tile of outputs: activation rows `r0..r0 + 16` by panels `p` and `p + 1` (those that exist). A tile's row is
/// both panels' 16 outputs, next to each other in the output's row: one 64-byte store each (16-byte stores, four a
/// row, filled the store buffer while the output's lines came in from memory: 7.6 % of a prefill-heavy job).
#[inline]
#[target_feature(enable = "avx512f")]
fn write_tile(out: Out, tile: &Tile<f32>, p: usize, r0: usize) {
    // SAFETY: `store_rows` hands row `r0 + i`'s 16 floats from column `8 p`, this task's to write; a tile's row is
    // 64 bytes, 64-byte aligned; the CPU has AVX-512 F (this function's features).
    let whole = out.store_rows::<COLS, ROWS>(p * PANEL, r0, |i, at| unsafe { _mm512_storeu_ps(at, _mm512_load_ps(tile.0[i].as_ptr())) });
    if !whole {
        let row = |i: usize, half: usize| -> &[f32; PANEL] { tile.0[i][PANEL * half..PANEL * half + PANEL].try_into().expect("eight lanes") };
        for i in 0..ROWS {
            for half in 0..2 {
                if (p + half) * PANEL < out.n {
                    out.write_lanes(r0 + i, (p + half) * PANEL, row(i, half));
                }
            }
        }
    }
}

/// `NB` pairs of panels (`pair[j]` holds panels `p[j]`, `p[j] + 1`) times `NA` tiles of 16 activation rows from
/// row `r0`. Per step (block, or group for `U8`), up to 2 x 2 tile products, each tile load serving two of them;
/// each product is followed by the float steps of the same tile product one step before, so that the tile unit
/// computes a step while the vector units finish the last (the sums alternate between two sets of buffers).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn macro_tile<const NA: usize, const NB: usize, const T: u8>(w: &Packed, pair: &[Pair; 2], p: [usize; 2], x: &Acts, r0: usize, sums: &mut [[Tile<i32>; 4]; 2], acc: &mut [Tile<f32>; 4], out: Out) {
    let (k, blocks) = (w.k, w.k / 32);
    let groups = if T == U8 { 2 } else { 1 };
    assert!(r0.is_multiple_of(ROWS) && r0 + NA * ROWS <= x.rows() && x.tiles.codes().len() == x.rows() / ROWS * ROWS * k, "activation tile out of range (a bug)");
    assert!((0..NB).all(|j| pair[j].codes.len() == 8 * blocks), "pair layout (a bug)");
    let steps = groups * blocks;
    for s in 0..=steps {
        let (now, before) = sums.split_at_mut(1);
        let (now, before) = if s % 2 == 0 { (&mut now[0], &before[0]) } else { (&mut before[0], &now[0]) };
        let (b, h) = (s.min(steps - 1) / groups, s % groups);
        let xs = |a: usize| x.tiles.codes()[((r0 / ROWS + a) * blocks + b) * ROWS * 32 + 16 * h..].as_ptr().cast::<u8>();
        let ws = |j: usize| pair[j].codes[8 * b + 4 * h..].as_ptr().cast::<u8>();
        for c in 0..4 {
            let (a, j) = (c / 2, c % 2);
            if a >= NA || j >= NB {
                continue;
            }
            if s < steps {
                // SAFETY: the tiles are configured (`run_tiles`, width `32 / groups`): an activation tile reads 16
                // rows of that many codes at stride 32 from tile `r0 / 16 + a` (`< x.rows() / 16`), block `b`,
                // offset `16 h`: inside that block's 512 bytes of `x.tiles.codes`; a weight tile `8 / groups` lines
                // from line `8 b + 4 h` of a pair's `8 * blocks`. Each product's operands are loaded before it (the
                // first product of a step loads A[0] and B[0], the second B[1], the third A[1]), and writes its 1
                // KiB of `now`.
                unsafe {
                    match c {
                        0 => {
                            load::<4>(xs(0), 32);
                            load::<6>(ws(0), 64);
                            product::<0>(signed(T), &mut now[0]);
                        }
                        1 => {
                            load::<7>(ws(1), 64);
                            product::<1>(signed(T), &mut now[1]);
                        }
                        2 => {
                            load::<5>(xs(1), 32);
                            product::<2>(signed(T), &mut now[2]);
                        }
                        _ => product::<3>(signed(T), &mut now[3]),
                    }
                }
            }
            if s > 0 {
                finish::<T>(&mut acc[c], &before[c], s - 1, &pair[j], x, r0 + ROWS * a);
            }
        }
    }
    for a in 0..NA {
        for j in 0..NB {
            write_tile(out, &acc[2 * a + j], p[j], r0 + ROWS * a);
        }
    }
}

/// A pair of panels of a per-256 layout (`Data::K4`, `Data::K5`, `Data::Q6`) in the tile unit's layout: each weight
/// `w` (`sc * q` for K4 and K5, at most 63 x 31; `sc * (q - 32)` for Q6) split exactly into two bytes, so that two tile products per
/// 64 columns give the 256's integer sums with no float step between its blocks.
struct SuperPair {
    /// `[k / 64, 2, 16 lines]`: per 64 columns, the high parts' weight tile, then the low parts'. Line `j` holds, for
    /// each of the 16 weight rows, its four weights `4j..4j + 4` of the 64 (`tdpbsud`/`tdpbssd`'s `B`, 64 deep).
    codes: Vec<Line>,
    /// `[k / 256, 16]`: `d` and (K4) `-dmin` per 256 of the 16 weight rows.
    d: Vec<f32>,
    dmin: Vec<f32>,
    /// K4: `[k / 256, 4, 16]`: per 256, pair of blocks `t` and weight row, the two blocks' mins as 16-bit halves.
    mn: Vec<i32>,
}

impl SuperPair {
    fn new(k: usize) -> SuperPair {
        let supers = k / 256;
        SuperPair { codes: vec![Line([0; 64]); k / 2], d: vec![0.0; 16 * supers], dmin: vec![0.0; 16 * supers], mn: vec![0; 64 * supers] }
    }

    /// The scales of one block (or half) of both panels, 8 bytes each at `at[0]` and `at[1]` of `sc`, as the two
    /// byte patterns [`SuperPair::split`] multiplies by: in 32-bit lane `l` (weight row `l` of the 16), the row's
    /// scale at bytes 0 and 2 (`even`) or 1 and 3 (`odd`), zero elsewhere.
    ///
    /// Safety: the CPU has AVX-512 F and BW; 8 bytes at each of `at` lie inside `sc`; `patterns` are
    /// [`SuperPair::patterns`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn scales(sc: *const u8, at: [usize; 2], patterns: &[__m512i; 2]) -> (__m512i, __m512i) {
        // SAFETY: the caller's contract.
        let rows = unsafe { _mm_unpacklo_epi64(_mm_loadl_epi64(sc.add(at[0]).cast()), _mm_loadl_epi64(sc.add(at[1]).cast())) };
        let all = _mm512_broadcast_i32x4(rows);
        (_mm512_shuffle_epi8(all, patterns[0]), _mm512_shuffle_epi8(all, patterns[1]))
    }

    /// The byte shuffles [`SuperPair::scales`] takes, even then odd: 128-bit lane `i` serves rows `4i..4i + 4`; -1
    /// gives zero.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn patterns() -> [__m512i; 2] {
        [false, true].map(|odd| {
            let mut c = [-1i8; 64];
            for (b, c) in c.iter_mut().enumerate() {
                if b % 2 == usize::from(odd) {
                    *c = (b / 16 * 4 + b % 16 / 4) as i8;
                }
            }
            // SAFETY: 64 bytes.
            unsafe { _mm512_loadu_si512(c.as_ptr().cast()) }
        })
    }

    /// 32 bytes at `at[0]` and at `at[1]` of `v` side by side: both panels' chunk, a line's order.
    ///
    /// Safety: the CPU has AVX-512 F; 32 bytes at each of `at` lie inside `v`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn two(v: *const u8, at: [usize; 2]) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(v.add(at[0]).cast())), _mm256_loadu_si256(v.add(at[1]).cast())) }
    }

    /// Stores a line's high and low parts: line `j` (of 16) of block pair `c`'s high tile and of its low tile.
    ///
    /// Safety: the CPU has AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store(&mut self, c: usize, j: usize, (hi, lo): (__m512i, __m512i)) {
        // SAFETY: the caller's contract for the instructions; each index is checked (a line is 64 bytes).
        unsafe {
            _mm512_storeu_si512(self.codes[32 * c + j].0.as_mut_ptr().cast(), hi);
            _mm512_storeu_si512(self.codes[32 * c + 16 + j].0.as_mut_ptr().cast(), lo);
        }
    }

    /// Both panels' per-256 values of `v` (`[panel, k / 256, 8]`) into `to` (`[k / 256, 16]`), as f32 by `float`.
    fn spread<T: Copy>(to: &mut [f32], v: &[T], p: usize, supers: usize, float: impl Fn(T) -> f32) {
        for s in 0..supers {
            for (half, panel) in [p, p + 1].into_iter().enumerate() {
                let at = (panel * supers + s) * PANEL;
                for (to, &v) in to[16 * s + 8 * half..16 * s + 8 * half + 8].iter_mut().zip(&v[at..at + 8]) {
                    *to = float(v);
                }
            }
        }
    }

    /// The per-256 values of panels `p` and `p + 1` of a K4 or K5 matrix (`Data::K4`'s `mn`, `d`, `-dmin`): `d` and
    /// `-dmin` as f32, each pair of blocks' mins as one 32-bit lane of two 16-bit halves, block `2t` low (as
    /// `Acts::bsums` pairs them). Plain code, so that machines without the tile unit test it.
    fn k4_scales(&mut self, mn: &[u8], d: &[u16], dmin: &[u16], p: usize, supers: usize) {
        Self::spread(&mut self.d, d, p, supers, super::half_f32);
        Self::spread(&mut self.dmin, dmin, p, supers, super::half_f32);
        for s in 0..supers {
            for (half, panel) in [p, p + 1].into_iter().enumerate() {
                for t in 0..4 {
                    let from = &mn[((panel * supers + s) * 4 + t) * 16..][..16];
                    for l in 0..PANEL {
                        self.mn[(4 * s + t) * 16 + 8 * half + l] = (from[2 * l] as u32 | (from[2 * l + 1] as u32) << 16) as i32;
                    }
                }
            }
        }
    }

    /// 64 codes (unsigned, at most 63) times their rows' scales ([`SuperPair::scales`], signed), less `offset` (per
    /// 16-bit word), exactly in 16 bits, split into the weights' high (`w >> SHIFT`, arithmetic) and low (`w & (2^SHIFT
    /// - 1)`) bytes, in the codes' order. Each 16-bit product is one code's (`vpmaddubsw` with the other byte's scale
    /// zero): even codes from `even`, odd codes from `odd`.
    ///
    /// Safety: the CPU has AVX-512 F and BW.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn split<const SHIFT: u32>(codes: __m512i, even: __m512i, odd: __m512i, offset: __m512i) -> (__m512i, __m512i) {
        let we = _mm512_sub_epi16(_mm512_maddubs_epi16(codes, even), offset);
        let wo = _mm512_sub_epi16(_mm512_maddubs_epi16(codes, odd), offset);
        let (low, byte) = (_mm512_set1_epi16((1 << SHIFT) - 1), _mm512_set1_epi16(0xFF));
        let lo = _mm512_or_si512(_mm512_and_si512(we, low), _mm512_slli_epi16::<8>(_mm512_and_si512(wo, low)));
        let hi = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16::<SHIFT>(we), byte), _mm512_slli_epi16::<8>(_mm512_srai_epi16::<SHIFT>(wo)));
        (hi, lo)
    }

    /// Lays out blocks `blocks` of panels `p` and `p + 1` ([`SuperPair::fill_k4`] or [`SuperPair::fill_q6`] by
    /// `T`), and with the last block the per-256 scales: a pair laid out a slice at a time, while the tiles compute
    /// with another ([`run_supers`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn fill<const T: u8>(&mut self, w: &Packed, p: usize, blocks: Range<usize>) {
        if with_mins(T) {
            self.fill_k4(w, p, blocks);
        } else {
            self.fill_q6(w, p, blocks);
        }
    }

    /// Blocks `range` of panels `p` and `p + 1` of a K4 or K5 matrix: each weight `w = sc * q` (K4 0..=945, K5
    /// 0..=1953) as `w >> 8` (0..=7) and `w & 255`, both unsigned: `w = 256 hi + lo`; with the matrix's last block,
    /// the per-256 scales and mins.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn fill_k4(&mut self, w: &Packed, p: usize, range: Range<usize>) {
        let (Data::K4 { qs, sc, mn, d, dmin } | Data::K5 { qs, sc, mn, d, dmin }) = &w.data else { unreachable!("fill_k4 of another layout (a bug)") };
        let wide = matches!(w.data, Data::K5 { .. });
        let (blocks, supers) = (w.k / 32, w.k / 256);
        assert!((p + 2) * blocks * if wide { 256 } else { 128 } <= qs.len() && (p + 2) * blocks * PANEL <= sc.len() && (p + 2) * supers * 64 <= mn.len() && (p + 2) * supers * PANEL <= d.len() && dmin.len() == d.len(), "K4 pair out of range (a bug)");
        assert!(self.codes.len() == 16 * blocks && self.d.len() == 16 * supers && self.mn.len() == 64 * supers, "K4 pair layout (a bug)");
        assert!(range.end <= blocks, "K4 blocks out of range (a bug)");
        let (nibble, zero, patterns) = (_mm512_set1_epi8(0x0F), _mm512_setzero_si512(), Self::patterns());
        for b in range.clone() {
            let (c, h2) = (b / 2, b % 2);
            let at = [p * blocks + b, (p + 1) * blocks + b];
            // SAFETY: 8 scales at `8 at[i]` and 128 code bytes at `128 at[i]` lie inside `sc` and `qs` (`at[i] < (p + 2)
            // blocks`, asserted above); lines `32 c + 16 + j` < `16 blocks` for `j < 16`, 64 bytes each.
            unsafe {
                let (even, odd) = Self::scales(sc.as_ptr(), at.map(|a| a * PANEL), &patterns);
                if wide {
                    // K5: 256 code bytes per panel and block (inside `qs`: `(p + 2) blocks 256`, asserted above),
                    // chunk `g` the weights `4g..4g + 4` of each row (line `8 h2 + g`).
                    for g in 0..8 {
                        self.store(c, 8 * h2 + g, Self::split::<8>(Self::two(qs.as_ptr(), at.map(|a| 256 * a + 32 * g)), even, odd, zero));
                    }
                    continue;
                }
                for t in 0..4 {
                    let raw = Self::two(qs.as_ptr(), at.map(|a| 128 * a + 32 * t));
                    // Low nibbles: weights `4t..4t + 4` of the block (line `8 h2 + t` of the 64); high nibbles:
                    // `16 + 4t..` (line `8 h2 + 4 + t`).
                    self.store(c, 8 * h2 + t, Self::split::<8>(_mm512_and_si512(raw, nibble), even, odd, zero));
                    self.store(c, 8 * h2 + 4 + t, Self::split::<8>(_mm512_and_si512(_mm512_srli_epi16::<4>(raw), nibble), even, odd, zero));
                }
            }
        }
        if range.end < blocks || range.is_empty() {
            return;
        }
        self.k4_scales(mn, d, dmin, p, supers);
    }

    /// Panels `p` and `p + 1` of a Q6 matrix: each weight `w = sc * (q - 32)` as `w >> 6` (signed, -64..=64) and
    /// `w & 63` (unsigned): `w = 64 hi + lo`. A K3 matrix (Q3_K) the same way, `w = sc * (c - 4)` (-124..=128).
    /// Blocks `range` of them; with the matrix's last block, the per-256 scales.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    fn fill_q6(&mut self, w: &Packed, p: usize, range: Range<usize>) {
        let (Data::Q6 { qs, sc, d } | Data::K3 { qs, sc, d }) = &w.data else { unreachable!("fill_q6 of another layout (a bug)") };
        // K3: 96 bytes of bit planes per panel and block, codes standing for `c - 4`.
        let three = matches!(w.data, Data::K3 { .. });
        let (per, center) = super::signed_codes(&w.data);
        let (blocks, supers) = (w.k / 32, w.k / 256);
        assert!((p + 2) * blocks * per <= qs.len() && (p + 2) * blocks * 16 <= sc.len() && (p + 2) * supers * PANEL <= d.len(), "Q6 pair out of range (a bug)");
        assert!(self.codes.len() == 16 * blocks && self.d.len() == 16 * supers, "Q6 pair layout (a bug)");
        assert!(range.end <= blocks, "Q6 blocks out of range (a bug)");
        let (center, patterns, low2, low1) = (_mm512_set1_epi8(center as i8), Self::patterns(), _mm512_set1_epi8(3), _mm512_set1_epi8(1));
        for b in range.clone() {
            let (c, h2) = (b / 2, b % 2);
            let at = [p * blocks + b, (p + 1) * blocks + b];
            // K3: both panels' high plane (32 bytes at `96 at[i] + 64`, inside `qs`: `(p + 2) blocks 96`, asserted
            // above); every chunk's high bit.
            // SAFETY: as said, with the CPU's AVX-512 F (this function's features).
            let high = if three { unsafe { Self::two(qs.as_ptr(), at.map(|a| 96 * a + 64)) } } else { _mm512_setzero_si512() };
            for h in 0..2 {
                // SAFETY: 8 scales at `(2 at[i] + h) 8` and 32 codes at `256 at[i] + 32 g` (K3: 32 bytes at `96 at[i]
                // + 32 h`) lie inside `sc` and `qs` (`at[i] < (p + 2) blocks`, asserted above); lines `32 c + 16 + 8 h2
                // + g` < `16 blocks`, 64 bytes each.
                unsafe {
                    let (even, odd) = Self::scales(sc.as_ptr().cast(), at.map(|a| (2 * a + h) * PANEL), &patterns);
                    // `32 sc` per word: `sc * (q - 32) = sc q - 32 sc`, at most 128 x 63 in magnitude before (K3: `4
                    // sc`, `sc * (c - 4)`).
                    let offset = _mm512_maddubs_epi16(center, even);
                    // K3: chunks `4 h..4 h + 4`'s low plane.
                    let low = if three { Self::two(qs.as_ptr(), at.map(|a| 96 * a + 32 * h)) } else { _mm512_setzero_si512() };
                    for g in 4 * h..4 * h + 4 {
                        let codes = if three {
                            // Chunk `g`'s low bits at bits `2 (g % 4)` of the low plane, its high bit at bit `g` of the
                            // high plane, moved to bit 2: shifts of 16-bit words, each byte masked to its own bits.
                            let lo = _mm512_and_si512(_mm512_srl_epi16(low, _mm_cvtsi32_si128(2 * (g % 4) as i32)), low2);
                            let hi = _mm512_and_si512(_mm512_srl_epi16(high, _mm_cvtsi32_si128(g as i32)), low1);
                            _mm512_or_si512(lo, _mm512_slli_epi16::<2>(hi))
                        } else {
                            Self::two(qs.as_ptr(), at.map(|a| 256 * a + 32 * g))
                        };
                        self.store(c, 8 * h2 + g, Self::split::<6>(codes, even, odd, offset));
                    }
                }
            }
        }
        if range.end == blocks && !range.is_empty() {
            Self::spread(&mut self.d, d, p, supers, |d| d);
        }
    }
}

/// One 256's tile products for `NA` tiles of 16 activation rows (`x[a]`, the 256's first 1 KiB of 64 columns, the
/// next three following) by one pair's high and low weight tiles (`w`, the 256's first 64 lines: per 64 columns 16
/// high lines, then 16 low), summed in the tiles: `tmm{2a}` the high parts' sums, `tmm{2a + 1}` the low parts'.
/// Q6's high parts are signed (`tdpbssd`), K4's unsigned; the low parts are always unsigned (`tdpbsud`).
///
/// Safety: the tiles are configured for 16 rows of 64 bytes (`Config::new(64)`); each `x[a]` (`a < NA`) points at 4
/// KiB and `w` at 128 lines (8 KiB).
#[inline(always)]
unsafe fn super_products<const NA: usize, const T: u8>(x: [*const u8; 2], w: *const Line) {
    macro_rules! run {
        ($hi:literal, $two:literal) => {
            asm!(
                "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
                "2:",
                "tileloadd tmm6, [{w} + {line}*1]",
                "tileloadd tmm7, [{w} + {line}*1 + 1024]",
                "tileloadd tmm4, [{x0} + {line}*1]",
                concat!($hi, " tmm0, tmm4, tmm6"),
                "tdpbsud tmm1, tmm4, tmm7",
                concat!($two, "tileloadd tmm5, [{x1} + {line}*1]"),
                concat!($two, $hi, " tmm2, tmm5, tmm6"),
                concat!($two, "tdpbsud tmm3, tmm5, tmm7"),
                "add {x0}, 1024", "add {x1}, 1024", "add {w}, 2048",
                "dec {n}",
                "jnz 2b",
                x0 = inout(reg) x[0] => _, x1 = inout(reg) x[1] => _, w = inout(reg) w => _,
                n = inout(reg) 4usize => _, line = in(reg) 64usize, options(nostack, readonly),
            )
        };
    }
    // SAFETY: the caller's contract for the loads (`x[1]` is read only when `NA == 2`: the one-tile variant's lines
    // with it are comments).
    unsafe {
        match (NA, T == Q6) {
            (2, true) => run!("tdpbssd", ""),
            (2, false) => run!("tdpbsud", ""),
            (_, true) => run!("tdpbssd", "# "),
            _ => run!("tdpbsud", "# "),
        }
    }
}

/// Stores the sums [`super_products`] left in `tmm0..tmm{2 NA}` to `out[..2 NA]`.
///
/// Safety: the tiles are configured as for [`super_products`], which ran last.
#[inline(always)]
unsafe fn store_sums<const NA: usize>(out: &mut [Tile<i32>; 4]) {
    let c = out.as_mut_ptr();
    // SAFETY: the stores write tiles `out[0..2 NA]`, 1 KiB each.
    unsafe {
        asm!("tilestored [{c} + {line}*1], tmm0", "tilestored [{c} + {line}*1 + 1024], tmm1", line = in(reg) 64usize, c = in(reg) c, options(nostack));
        if NA == 2 {
            asm!("tilestored [{c} + {line}*1 + 2048], tmm2", "tilestored [{c} + {line}*1 + 3072], tmm3", line = in(reg) 64usize, c = in(reg) c, options(nostack));
        }
    }
}

/// The float steps of 256 `s` for one tile of 16 activation rows from `r0` by a pair's 16 weight rows: the exact
/// integer `2^SHIFT C_hi + C_lo` (K4, K5: 8; Q6: 6), then per output `acc = fma(sum, d_w * d_x, acc)`, and for K4, K5 the
/// mins' integer `sum of mn x sum(x)` (16-bit pairs, `vpmaddwd`) and `acc = fma(msum, -dmin_w * d_x, acc)`: the
/// portable kernels' `run_supers`, in the same order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn finish_super<const T: u8>(acc: &mut Tile<f32>, hi: &Tile<i32>, lo: &Tile<i32>, s: usize, pair: &SuperPair, x: &Acts, r0: usize) {
    let first = s == 0;
    let (m, order, blocks) = (x.rows(), &x.tiles, x.k / 32);
    assert!(r0 + ROWS <= m && (s + 1) * m <= order.d.len() && 16 * (s + 1) <= pair.d.len(), "scales out of range (a bug)");
    assert!(!with_mins(T) || (64 * (s + 1) <= pair.mn.len() && pair.dmin.len() == pair.d.len() && x.bsums.len() == m * blocks && 8 * s + 8 <= blocks), "mins out of range (a bug)");
    // SAFETY (these pointers, and every use below): rows `r0..r0 + 16` of 256 `s`, the pair's 16 scales at `16 s`
    // and 64 mins at `64 s`, and rows `r0 + i`'s code sums of blocks `8 s..8 s + 8` are in range (asserted above);
    // the CPU has AVX-512 F and BW (this function's features).
    unsafe {
        let xd = order.d.as_ptr().add(s * m + r0);
        let dw = _mm512_loadu_ps(pair.d.as_ptr().add(16 * s));
        let (mw, mins) = if with_mins(T) {
            (_mm512_loadu_ps(pair.dmin.as_ptr().add(16 * s)), std::array::from_fn::<_, 4, _>(|t| _mm512_loadu_si512(pair.mn.as_ptr().add((4 * s + t) * 16).cast())))
        } else {
            (_mm512_setzero_ps(), [_mm512_setzero_si512(); 4])
        };
        for i in 0..ROWS {
            let (h, l) = (_mm512_load_si512(hi.0[i].as_ptr().cast()), _mm512_load_si512(lo.0[i].as_ptr().cast()));
            let sum = if with_mins(T) { _mm512_add_epi32(_mm512_slli_epi32::<8>(h), l) } else { _mm512_add_epi32(_mm512_slli_epi32::<6>(h), l) };
            let xs = _mm512_set1_ps(*xd.add(i));
            let mut v = if first { _mm512_setzero_ps() } else { _mm512_load_ps(acc.0[i].as_ptr()) };
            v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, xs), v);
            if with_mins(T) {
                let sums = x.bsums.as_ptr().add((r0 + i) * blocks + 8 * s).cast::<i32>();
                // One chain of `vpdpwssd` (VNNI's 16-bit pairs multiplied and added into 32 bits): exact, at most
                // 8 x 63 x 4,064 in magnitude.
                let mut msum = _mm512_madd_epi16(mins[0], _mm512_set1_epi32(sums.read_unaligned()));
                for (t, mins) in mins.iter().enumerate().skip(1) {
                    msum = _mm512_dpwssd_epi32(msum, *mins, _mm512_set1_epi32(sums.add(t).read_unaligned()));
                }
                v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(mw, xs), v);
            }
            _mm512_store_ps(acc.0[i].as_mut_ptr(), v);
        }
    }
}

/// [`run`] for the per-256 layouts (`T`: [`K4`], [`K5`], [`Q6`]), at least one whole tile of activation rows and one pair of
/// panels. Per pair of panels (laid out once, [`SuperPair`]) and group of rows, 256 by 256: the 256's weight tiles
/// (8 KiB) stay in the L1 cache while every two tiles of activation rows pass over them, each pair of row tiles'
/// sums accumulated in the tile registers over the 256's four 64-column steps (two products each: the weights'
/// high and low parts) and stored once; the float steps of one such item run while the tile unit computes the next.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn run_supers<const T: u8>(w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    let (m, k) = (x.rows(), w.k);
    let (tiles, supers, chunks) = (m / ROWS, k / 256, k / 64);
    let (first, end) = (rows.start / PANEL, rows.end.div_ceil(PANEL));
    let pairs = (end - first) / 2;
    assert!(x.supers && k.is_multiple_of(256) && x.tiles.codes().len() == tiles * ROWS * k, "activations per 256 in the tiles' order (a bug)");
    let config = Config::new(64);
    // SAFETY: `config` is a valid palette-1 configuration (every tile 16 rows of 64 bytes), 64 bytes.
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    let blocks = k / 32;
    let mut sums = [[Tile([[0; COLS]; ROWS]); 4]; 2];
    // One accumulator per tile of rows of a group.
    // Tiles of rows per group: at most `ROW_GROUP` rows, at most `GROUP_BYTES` of codes (128 rows at k = 8,192),
    // a whole number of pairs of tiles.
    let group_tiles = (GROUP_BYTES / (2 * ROWS * k)).clamp(1, ROW_GROUP / ROWS / 2) * 2;
    let mut acc = vec![Tile([[0f32; COLS]; ROWS]); group_tiles];
    // The units of work, (group of rows, pair of panels), in order. Two laid-out pairs: the unit's, `laid[held]`,
    // and the next unit's, laid out a slice with each item of this one's (the vector units lay it out while the
    // tile unit computes: laid out between units, 7-8 % of a prefill-heavy job waited for it).
    let units: Vec<(usize, usize)> = (0..tiles).step_by(group_tiles).flat_map(|g| (0..pairs).map(move |q| (g, first + 2 * q))).collect();
    let mut laid = [SuperPair::new(k), SuperPair::new(k)];
    let mut held = 0;
    if let Some(&(_, p)) = units.first() {
        laid[0].fill::<T>(w, p, 0..blocks);
    }
    for (u, &(group, p)) in units.iter().enumerate() {
        let group_end = (group + group_tiles).min(tiles);
        {
            let (a, b) = laid.split_at_mut(1);
            let (pair, next) = if held == 0 { (&a[0], &mut b[0]) } else { (&b[0], &mut a[0]) };
            // The next unit's pair, where it is another (one pair and several groups: the same, laid out once).
            let next_p = units.get(u + 1).map(|&(_, np)| np).filter(|&np| np != p);
            let items = supers * (group_end - group).div_ceil(2);
            // Items (256 `s`, first row tile `t`, tiles `na`) in order; the one before's sums in `sums[done % 2]`.
            let mut before: Option<(usize, usize, usize)> = None;
            let mut item = 0;
            for s in 0..supers {
                for t in (group..group_end).step_by(2) {
                    let na = (group_end - t).min(2);
                    if s == 0 {
                        // The lines these rows' outputs go to, asked for while the tiles compute all of the pair's
                        // 256s: written in a burst at the end (`write_tile`), they waited on memory, 6-8 % of a
                        // prefill-heavy job.
                        for r in ROWS * t..ROWS * (t + na) {
                            out.prefetch_write(r, p * PANEL);
                        }
                    }
                    let xs = [0, 1].map(|a| x.tiles.codes()[((t + a.min(na - 1)) * chunks + 4 * s) * 1024..].as_ptr().cast::<u8>());
                    // SAFETY: configured for 16 rows of 64 bytes (above); tile `t + a` (`< tiles`) has `chunks` KiB of
                    // codes (asserted length), of which the 256's four from `4 s` (`s < supers`); the pair's lines
                    // from `128 s` are the 256's 128 (`k / 2` lines in all: `SuperPair::new`).
                    unsafe {
                        if na == 2 {
                            super_products::<2, T>(xs, pair.codes[128 * s..].as_ptr());
                        } else {
                            super_products::<1, T>(xs, pair.codes[128 * s..].as_ptr());
                        }
                    }
                    let (now, last) = sums.split_at_mut(1);
                    let (now, last) = if item % 2 == 0 { (&mut now[0], &last[0]) } else { (&mut last[0], &now[0]) };
                    if let Some((sb, tb, nb)) = before {
                        for a in 0..nb {
                            finish_super::<T>(&mut acc[tb - group + a], &last[2 * a], &last[2 * a + 1], sb, pair, x, ROWS * (tb + a));
                        }
                    }
                    if let Some(np) = next_p {
                        // This item's slice of the next pair's blocks (the last slice ends at the last block), before
                        // the stores below wait for the tiles.
                        next.fill::<T>(w, np, blocks * item / items..blocks * (item + 1) / items);
                    }
                    // SAFETY: the products above ran last on these tiles; `now` is 4 KiB.
                    unsafe {
                        if na == 2 {
                            store_sums::<2>(now);
                        } else {
                            store_sums::<1>(now);
                        }
                    }
                    before = Some((s, t, na));
                    item += 1;
                }
            }
            if let Some((sb, tb, nb)) = before {
                let last = &sums[(item - 1) % 2];
                for a in 0..nb {
                    finish_super::<T>(&mut acc[tb - group + a], &last[2 * a], &last[2 * a + 1], sb, pair, x, ROWS * (tb + a));
                }
            }
            if next_p.is_some() {
                held = 1 - held;
            }
        }
        for t in group..group_end {
            write_tile(out, &acc[t - group], p, ROWS * t);
        }
    }
    leftovers(w, first..end, pairs, x, out);
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::super::{pack, tests::matrix, Data, Packed, PANEL};
    use super::{Pair, SuperPair};

    /// The per-32 layouts' pairs of panels as the int8 tiles take them (`Pair::fill`, AVX2 code): each weight
    /// rebuilt from a tile line's code and its row's scale (and offset) is the packed matrix's, bit for bit, for
    /// Q4_0 and Q4_1 (`Q4`), Q8_0 and Q5_0 (`S8`) and Q5_1 (`U8`). The tile products that read them run only where the
    /// CPU has the tile unit; this runs wherever it has AVX2.
    #[test]
    fn the_tiles_take_the_per_32_layouts_codes_and_scales_as_packed() {
        if !is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 here: Pair::fill not checked");
            return;
        }
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            let (n, k) = (40, 576);
            // Q5_1 in `U8` and Q5_0 in `S8`, the layouts an AMX CPU holds them in (`pack::narrow_codes`).
            let q = matrix(dtype, n, k, 5);
            let packed = pack::pack_with(dtype, &q.data().unwrap(), n, k, false).unwrap().unwrap();
            let weights = packed.dequantize();
            let (blocks, u8) = (k / 32, matches!(packed.data, Data::U8 { .. }));
            let (nibbles, offsets) = match &packed.data {
                Data::Q4 { m, .. } => (true, !m.is_empty()),
                Data::U8 { .. } => (false, true),
                Data::S8 { .. } => (false, false),
                _ => panic!("{dtype:?} packed as a per-256 layout"),
            };
            for p in [0, 3] {
                let mut pair = Pair::new(blocks, if u8 { 2 } else { 1 });
                // SAFETY: the CPU has AVX2 (checked above); panels 0..=4 exist (40 rows).
                unsafe { pair.fill(&packed, p) };
                for half in 0..2 {
                    for l in 0..PANEL {
                        let row = (p + half) * PANEL + l;
                        for col in 0..k {
                            let (b, i) = (col / 32, col % 32);
                            let line = if nibbles { i / 16 * 4 + i % 16 / 4 } else { i / 4 };
                            let byte = pair.codes[8 * b + line].0[32 * half + 4 * l + i % 4];
                            let at = 16 * if u8 { 2 * b + i / 16 } else { b } + 8 * half + l;
                            let code = if nibbles && offsets || u8 { byte as f32 } else { byte as i8 as f32 };
                            let w = if offsets { pair.d[at] * code + pair.m[at] } else { pair.d[at] * code };
                            assert_eq!(w.to_bits(), weights[row * k + col].to_bits(), "{dtype:?} row {row}, column {col}: {w} vs {}", weights[row * k + col]);
                        }
                    }
                }
            }
        }
    }

    /// The tiles' per-256 values of a K4 or K5 pair, read from `Data::K4`'s bytes and f16s, are the file's: `d`,
    /// `-dmin` and each pair of blocks' mins, row by row. Plain code, checked on every machine (the tile products
    /// that use them run only where the CPU has the tile unit).
    #[test]
    fn the_tiles_take_q4_k_and_q5_k_scales_and_mins_as_the_file_stores_them() {
        for (dtype, block_bytes) in [(GgmlDType::Q4K, 144), (GgmlDType::Q5K, 176)] {
            let (n, k) = (40, 768);
            let q = matrix(dtype, n, k, 11);
            let bytes = q.data().unwrap().into_owned();
            let packed = Packed::from_qtensor(&q).unwrap().unwrap();
            let (Data::K4 { mn, d, dmin, .. } | Data::K5 { mn, d, dmin, .. } | Data::K5N { mn, d, dmin, .. }) = &packed.data else { panic!("{dtype:?} packed as another layout") };
            let supers = k / 256;
            let mut checked = 0;
            for p in [0, 3] {
                let mut pair = SuperPair::new(k);
                pair.k4_scales(mn, d, dmin, p, supers);
                for half in 0..2 {
                    for l in 0..PANEL {
                        let row = (p + half) * PANEL + l;
                        for s in 0..supers {
                            let b = &bytes[(row * supers + s) * block_bytes..][..block_bytes];
                            let (_, _, mins, d, dmin) = pack::kmin_block(b, dtype == GgmlDType::Q5K);
                            let lane = 16 * s + 8 * half + l;
                            assert_eq!((pair.d[lane], pair.dmin[lane]), (half::f16::from_bits(d).to_f32(), -half::f16::from_bits(dmin).to_f32()), "{dtype:?} row {row}, 256 {s}");
                            for t in 0..4 {
                                let both = pair.mn[(4 * s + t) * 16 + 8 * half + l] as u32;
                                assert_eq!([both & 0xFFFF, both >> 16], [mins[2 * t] as u32, mins[2 * t + 1] as u32], "{dtype:?} row {row}, 256 {s}, blocks {}", 2 * t);
                            }
                            checked += 1;
                        }
                    }
                }
            }
            assert_eq!(checked, 2 * 2 * PANEL * supers);
            // Not every min is zero (the check above would not see a layout error then).
            assert!(mn.iter().filter(|&&m| m != 0).count() > mn.len() / 2, "{dtype:?}: mins mostly zero");
        }
    }
}
