//! The CPU's matrix products for weights as a GGUF file stores them: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
//! Q6_K, F16 and BF16, at any width that is a whole number of the type's blocks.
//!
//! candle's CPU kernels for these types are chosen at compile time (`target-cpu`) and, for several of them
//! (Q4_1, Q5_0, Q5_1), scalar; its fast tiles take only widths that are multiples of 256. These are chosen at run
//! time ([`Level`]): AVX-512 VNNI (or AVX-VNNI), AVX2 with FMA and F16C, and a portable fallback, so one binary
//! is fast on every x86-64 CPU.
//!
//! The weights are repacked at load ([`pack`]) into layouts that keep every stored value: 4-bit codes with a
//! scale and offset per 32 (Q4_1; Q4_0 with its scale alone, its codes standing for `q - 8`), 8-bit codes with a
//! scale and offset per 16 (Q5_1), signed 8-bit codes with a scale per 32 (Q8_0, and Q5_0 as `q - 16`), and
//! Q4_K, Q5_K and Q6_K with their own small integer scales under a float scale per 256 ([`Data`]), each interleaved in
//! panels of eight weight rows ([`PANEL`]) so that one register holds four weights of each of eight rows: one
//! 8-bit product instruction then serves eight outputs, and each output's integer block sum lands in its own
//! 32-bit lane, ready for its scale.
//! Activations are quantized per row to signed 8-bit codes, rounded as llama.cpp rounds them for the same types:
//! with a scale per 32 values ([`store_scales`]), or per 256 for the k-quants ([`quantize_supers`], its `Q8_K`);
//! F16 and BF16 weights stay row-major and take the activations in f32.
//!
//! Every path computes each output with the same operations in the same order, so the levels give bit-identical
//! results, and a row's result does not depend on how many rows share its product. Quantized weights: per block
//! of 32 (or group of 16), the exact integer sum of code products, then one chain of fused multiply-adds per
//! output (`acc = fma(sum, d_w * d_x, acc)`, then `acc = fma(m_w, s_x, acc)` for types with an offset); for the
//! k-quants, per 256, the exact integer sum of the blocks' sums times their scales, then the same steps per 256.
//! Float weights: eight lanes of fused multiply-adds, then one fixed reduction ([`hsum8`]). The one exception is
//! bf16 weights at the AVX-512 BF16 and AMX levels, which a job names to have them multiplied by activations
//! rounded to bf16 ([`avx512_bf16_dots`], [`amx_bf16_tiles`]), and F16 weights on the AMX level's tiles.

#[cfg(target_arch = "x86_64")]
mod amx;
pub mod elementwise;
mod pack;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use crate::job::CpuKernels;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

/// The instruction set the kernels run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2, FMA and F16C (x86-64-v3: Intel since 2013, AMD since 2015).
    Avx2,
    /// The AVX2 level with VNNI's 8-bit dot products: AVX-512 VNNI (with VL), or AVX-VNNI.
    Vnni,
    /// The VNNI level with AVX-512 BF16's dot products for bf16 matrices (Intel since Cooper Lake, AMD since Zen
    /// 4), whose activations it rounds to bf16 ([`avx512_bf16_dots`]); every other product is VNNI's.
    Avx512Bf16,
    /// AVX-512 VNNI with the tile unit's 8-bit products for the quantized types (Intel since Sapphire Rapids),
    /// where Linux grants the process the tiles.
    Amx,
}

impl Level {
    /// The best level this CPU runs. The first call asks Linux for the tile unit where the CPU has one (see
    /// [`prepare`]).
    pub fn detected() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            let vnni = (is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")) || is_x86_feature_detected!("avxvnni");
            return match (avx2, vnni) {
                (true, true) if amx::granted() => Level::Amx,
                (true, true) if x86::has_avx512_bf16() => Level::Avx512Bf16,
                (true, true) => Level::Vnni,
                (true, false) => Level::Avx2,
                _ => Level::Portable,
            };
        }
        #[allow(unreachable_code)]
        Level::Portable
    }

    /// The level the kernels run at unless the job names another (`runtime.cpu_kernels`): the best this CPU runs, short of AMX.
    /// The AMX level's int8 tiles give the same bits, but are slower than VNNI's for products of a few rows and on
    /// some layouts, and its bf16 and F16 products differ: `auto` takes the int8 tiles only where they are faster
    /// (a model's products: [`model_level`]), and the whole level only when asked for.
    pub fn preferred() -> Level {
        Level::detected().min(Level::Vnni)
    }

    /// The level the kernels run at: the one [`Level::choose`] settled, [`Level::preferred`] until then.
    pub fn active() -> Level {
        match CHOSEN.load(Ordering::Relaxed) {
            0 => Level::preferred(),
            n => Level::ALL[n as usize - 1],
        }
    }

    /// Settles the level for the process from the job's `runtime.cpu_kernels` and returns it: the level asked
    /// for if the CPU has it; otherwise (or for `auto`) [`Level::preferred`], with a warning when a level was named.
    pub fn choose(asked: CpuKernels) -> Level {
        let level = Level::resolve(asked);
        let index = Level::ALL.iter().position(|&l| l == level).expect("every level is in ALL");
        CHOSEN.store(index as u8 + 1, Ordering::Relaxed);
        AUTO_TILES.store(asked == CpuKernels::Auto && level == Level::Vnni && Level::detected() == Level::Amx, Ordering::Relaxed);
        level
    }

    /// The kernels a model's products run with, as the load log names them: the active level's name, and where
    /// `auto` takes the tile unit's int8 products for large quantized products ([`model_level`]), `vnni+amx-int8`.
    pub fn active_name() -> &'static str {
        match Level::active() {
            Level::Vnni if AUTO_TILES.load(Ordering::Relaxed) => "vnni+amx-int8",
            level => level.name(),
        }
    }

    /// The level [`Level::choose`] would settle for `asked`, without settling it.
    fn resolve(asked: CpuKernels) -> Level {
        let named = match asked {
            CpuKernels::Auto => None,
            CpuKernels::Portable => Some(Level::Portable),
            CpuKernels::Avx2 => Some(Level::Avx2),
            CpuKernels::Vnni => Some(Level::Vnni),
            CpuKernels::Avx512Bf16 => Some(Level::Avx512Bf16),
            CpuKernels::Amx => Some(Level::Amx),
        };
        let detected = Level::detected();
        let level = match named {
            Some(level) if level <= detected => level,
            Some(level) => {
                tracing::warn!(asked = level.name(), detected = detected.name(), "runtime.cpu_kernels asks for kernels this CPU lacks; taking the default");
                Level::preferred()
            }
            None => Level::preferred(),
        };
        level
    }

    const ALL: [Level; 5] = [Level::Portable, Level::Avx2, Level::Vnni, Level::Avx512Bf16, Level::Amx];

    pub fn parse(name: &str) -> Option<Level> {
        match name {
            "portable" => Some(Level::Portable),
            "avx2" => Some(Level::Avx2),
            "vnni" => Some(Level::Vnni),
            "avx512-bf16" => Some(Level::Avx512Bf16),
            "amx" => Some(Level::Amx),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Vnni => "vnni",
            Level::Avx512Bf16 => "avx512-bf16",
            Level::Amx => "amx",
        }
    }

    /// Every level this CPU runs, lowest first.
    pub fn available() -> Vec<Level> {
        Level::ALL.into_iter().filter(|&l| l <= Level::detected()).collect()
    }
}

/// Settles the kernels' level before any thread is made: on a CPU with AMX, asks Linux for the tile unit (the
/// permission is the process's, and costs nothing until a thread uses a tile; asking first keeps the system call
/// off the threads' paths).
pub fn prepare() {
    let _ = Level::detected();
}

/// Whether [`Level::choose`] settled `auto` at VNNI on a CPU whose tile unit Linux grants: then the model's large
/// quantized products in the 4-bit, signed 8-bit and Q6_K layouts take the AMX level's int8 tiles ([`model_level`]).
static AUTO_TILES: AtomicBool = AtomicBool::new(false);

/// The fewest activation rows at which `auto` hands a quantized product to the int8 tiles ([`model_level`]).
const INT8_TILE_ROWS: usize = 32;

/// The fewest activation rows at which `auto` hands a product of at least [`LARGE_PRODUCT`] weights to the int8
/// tiles: one tile of rows (a decode step of 16 sequences). `bench kernels` at 16 rows on the 2-core Sapphire
/// Rapids VM (BENCHMARKS.md, 2026-12-06, item 5): the tiles take 0.75x VNNI's time on Llama-3.2-1B's 8192 x 2048
/// feed-forward matrices and SmolLM2's 32,000 x 576 output projection, 1.0-2.2x on matrices of 4 M weights or
/// fewer, where a task's tile set-up and weight layout is not paid back.
const LARGE_TILE_ROWS: usize = 16;

/// Weights in a product's matrices from which 16 rows take the tiles ([`LARGE_TILE_ROWS`]).
const LARGE_PRODUCT: usize = 8 << 20;

/// [`LARGE_PRODUCT`] for products whose matrices are all in the per-256 layouts (the k-quants), whose tiles hold a
/// 256's sums and take their float steps once per 256: on Llama-3.2-1B's q/k/v group (6.3 M weights) and output
/// projection (4.2 M) they beat VNNI at 16 rows too. The 1B jobs' decode-only steps (16 sequences), 8 M against 4
/// M, two pairs each on the same VM: Q4_K_M 114-115 -> 118-120 tok/s, Q3_K_M 116-118 -> 122, Q5_K_M 102 -> 103-104.
const LARGE_SUPERS_PRODUCT: usize = 4 << 20;

/// The level a model's product of `m` rows by `weights` runs at: [`Level::active`], except where the job left the
/// kernels to `auto` on a CPU with AMX ([`AUTO_TILES`]). There products of at least [`INT8_TILE_ROWS`] rows (of
/// [`LARGE_TILE_ROWS`] for matrices of [`LARGE_PRODUCT`] weights or more, [`LARGE_SUPERS_PRODUCT`] for the k-quants) by
/// matrices in the 4-bit (Q4_0, Q4_1), signed 8-bit (Q8_0, Q5_0), Q3_K, Q4_K, Q5_K or Q6_K layouts take the AMX level's int8 tiles,
/// whose results are the VNNI kernels' bits: measured faster there, slower on fewer rows (decode steps) and on the
/// `U8` layout (BENCHMARKS.md, 2026-12-05, late). bf16 and F16 products, whose AMX results differ, stay at VNNI
/// unless the job names `amx`.
fn model_level(weights: &[&Packed], m: usize) -> Level {
    let level = Level::active();
    let large = if weights.iter().all(|w| w.quant() == Quant::Supers) { LARGE_SUPERS_PRODUCT } else { LARGE_PRODUCT };
    let rows = if weights.iter().map(|w| w.n * w.k).sum::<usize>() >= large { LARGE_TILE_ROWS } else { INT8_TILE_ROWS };
    let tiles = level == Level::Vnni && m >= rows && AUTO_TILES.load(Ordering::Relaxed);
    if tiles && weights.iter().all(|w| matches!(w.data, Data::Q4 { .. } | Data::S8 { .. } | Data::Q6 { .. } | Data::K3 { .. } | Data::K4 { .. } | Data::K5 { .. })) {
        Level::Amx
    } else {
        level
    }
}

/// Memory a kernel will read next (attention's cache blocks, a decode step's weight panels), asked for a cache line
/// at a time ([`Ahead::line`]): a hint to the CPU that changes no result. It borrows the bytes it points into.
#[derive(Clone, Copy)]
pub struct Ahead<'a> {
    bytes: &'a [u8],
}

impl<'a> Ahead<'a> {
    pub const NONE: Ahead<'static> = Ahead { bytes: &[] };

    pub fn new(bytes: &'a [u8]) -> Ahead<'a> {
        Ahead { bytes }
    }

    /// Lines of 64 bytes it covers (the last perhaps partial).
    #[cfg(test)]
    pub fn lines(self) -> usize {
        self.bytes.len().div_ceil(64)
    }

    /// Asks for line `i` (bytes `64 i..`) to be brought into the L1 cache; nothing past the last line.
    #[inline(always)]
    pub fn line(self, i: usize) {
        #[cfg(target_arch = "x86_64")]
        if let Some(byte) = self.bytes.get(64 * i) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // SAFETY: the address is that of a byte of a borrowed slice (`get` checked it); a prefetch only hints
            // the cache, reads nothing into the program and writes nothing.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(byte).cast::<i8>()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }

    /// Asks for every line.
    #[inline(always)]
    pub fn all(self) {
        for i in 0..self.bytes.len().div_ceil(64) {
            self.line(i);
        }
    }
}

/// The level [`Level::choose`] settled, as its index in [`Level::ALL`] plus one; 0 until then. Every level
/// computes the same bits, so a kernel reading it while another thread settles it gives the same result either way.
static CHOSEN: AtomicU8 = AtomicU8::new(0);

/// Weight rows interleaved per panel in the quantized layouts: one 32-bit lane per row in a 256-bit register.
const PANEL: usize = 8;

/// A weight matrix `[n, k]` in one of the kernels' layouts.
pub struct Packed {
    n: usize,
    k: usize,
    /// The file's type, for the logs.
    stored: GgmlDType,
    data: Data,
}

/// The quantized layouts hold `ceil(n / 8)` panels of [`PANEL`] rows (the last one's missing rows zero), and per
/// panel and block of 32 weights, the codes of the eight rows interleaved four at a time (`pack::chunks`) and
/// their scales and offsets side by side (`[panel, block (or group), 8]`).
enum Data {
    /// 4-bit codes, 128 bytes per panel and block: chunk `t` of 32 bytes holds, in lane `l`, row `l`'s weights
    /// `4t..4t + 4` (low nibbles) and `16 + 4t..20 + 4t` (high nibbles); weight = `d * code + m` per block of 32,
    /// or with `m` empty (Q4_0: [`Packed::signed4`]) `d * (code - 8)`, the products' integer sums taking `8 x` the
    /// activations' code sum off, with no offset step. `d` and `m` are the file's f16 bits (`[panel, block, 8]`):
    /// 4.5 bits a weight for Q4_0, 5 for Q4_1, the file's.
    Q4 { qs: Vec<u8>, d: Vec<u16>, m: Vec<u16> },
    /// Codes of up to 6 bits, one byte each, 256 bytes per panel and block: chunk `g` of 32 bytes holds, in lane
    /// `l`, row `l`'s weights `4g..4g + 4`; weight = `d * code + m` per group of 16.
    U8 { qs: Vec<u8>, d: Vec<f32>, m: Vec<f32> },
    /// Q5_1 in five bits a code: its 5-bit codes in `K5N`'s 160 bytes per panel and block ([`k5n_code`]), not
    /// `U8`'s 256, and per block of 32 its `d` and `m` widened to f32 (`[panel, block, 8]`, one pair for both groups of
    /// 16, where `U8` holds a pair per group): 7 bits a weight, the file's 6. (The file's f16 bits, 6 bits a weight,
    /// took 1.05-1.15x the time of `U8`'s products at 16 to 512 rows on a Zen 3 core: a `vcvtph2ps` per group of 16
    /// and tile.) `U8`'s products, a group of 16 at a time, so the same bits. Products of more than 16 rows lay the
    /// codes out as `U8`'s bytes once for all the rows, as `K5N`'s. Held where `Q6N` is ([`pack::narrow_codes`]): the
    /// AMX level's int8 tiles read `U8`.
    U5 { qs: Vec<u8>, d: Vec<f32>, m: Vec<f32> },
    /// Signed codes in -127..=127, chunked as `U8` and stored offset by 128 (`code ^ 0x80` as a byte, 1..=255:
    /// VNNI multiplies them as unsigned and takes `128 x` the activations' code sum back off; AVX2 flips the bit
    /// back); weight = `d * code` per block of 32, `d` the file's f16 bits (`[panel, block, 8]`): 8.5 bits a weight,
    /// Q8_0's. `small` says every code is in -16..=15 (Q5_0's always): AVX2 then multiplies `code + 16` (0..=31) as
    /// unsigned and keeps four groups' products in 16 bits.
    S8 { qs: Vec<u8>, d: Vec<u16>, small: bool },
    /// Q5_0 in the file's 5.5 bits a weight: its 5-bit codes `q` (the weight is `d * (q - 16)`) in `K5N`'s 160 bytes
    /// per panel and block ([`k5n_code`]), not `S8`'s 256, and `S8`'s f16 `d` per block. Its products are `S8`'s
    /// with `small` (the exact integer `sum(q x) - 16 sum(x)` per block, then one float step), so the same bits.
    /// Products of more than 16 rows lay the codes out as bytes once for all the rows, as `K5N`'s. Held where `Q6N`
    /// is ([`pack::narrow_codes`]): the AMX level's int8 tiles read `S8`.
    S5 { qs: Vec<u8>, d: Vec<u16> },
    /// Q6_K as stored: 6-bit codes `q` one per byte, chunked as `U8`; a signed scale `sc` per 16 weights
    /// (`[panel, block, half, 8]`, 16 bytes per panel and block) and `d` per 256 (`[panel, k / 256, 8]`); weight =
    /// `d * sc * (q - 32)`: 8.6 bits a weight. Its products take the activations quantized per 256 ([`Acts::supers`],
    /// llama.cpp's `Q8_K`): per 256, the exact integer `sum over the 16 groups of sc * (sum(q x) - 32 sum(x))` (at
    /// most 256 x 127 x 128 x 32 < 2^31 in magnitude), then one float step, `acc = fma(sum, d_w * d_x, acc)`.
    Q6 { qs: Vec<u8>, sc: Vec<i8>, d: Vec<f32> },
    /// Q6_K in the file's 6.6 bits a weight: `Q6`'s codes in 192 bytes per panel and block, not 256. Bytes `32 t..32
    /// t + 32` (`t < 4`) hold `Q6`'s chunk `t` in their low six bits and the two high bits of chunk `t + 4` in their
    /// top two; bytes `128 + 32 h..` (`h < 2`) hold the low four bits of chunk `4 + 2 h` in their low nibbles, of
    /// chunk `5 + 2 h` in their high nibbles ([`q6n_code`]): a chunk comes back in one operation (`t < 4`) or four
    /// to five. `Q6`'s scales and products, so the same bits. A one-row product (a decode step) reads its weights
    /// once, from memory: 1.3x fewer bytes than `Q6`'s. Products of more than 16 rows lay the codes out as `Q6`'s
    /// bytes once for all the rows. Held where the process does not take the tile unit, whose int8 tiles read
    /// `Q6`'s bytes ([`pack::narrow_codes`]).
    Q6N { qs: Vec<u8>, sc: Vec<i8>, d: Vec<f32> },
    /// Q3_K as stored: 3-bit codes `c = q + 4` (0..=7: ggml's two low bits plus 4 for a set high bit), 96 bytes per
    /// panel and block: bytes `32 h..32 h + 32` (`h < 2`) hold chunks `4 h..4 h + 4` of `U8`'s order, chunk `g`'s
    /// two low bits at bits `2 (g % 4)` of each byte; bytes `64..96` hold every chunk's high bit, chunk `g`'s at bit
    /// `g`. `Q6`'s signed scale per 16 (`sc - 32`, -32..=31) and `d` per 256: weight = `d * sc * (c - 4)`, 3.6 bits
    /// a weight. Its products are `Q6`'s with the offset 4 for 32: per 256 the exact integer `sum over the 16 groups
    /// of sc * (sum(c x) - 4 sum(x))`, then one float step (llama.cpp's `vec_dot_q3_K_q8_K`).
    K3 { qs: Vec<u8>, sc: Vec<i8>, d: Vec<f32> },
    /// Q4_K as stored: 4-bit codes `q` chunked as `Q4`; per block of 32 an unsigned 6-bit scale `sc`
    /// (`[panel, block, 8]`) and min `mn` (in pairs of blocks, widened to 16 bits for `vpmaddwd` as they are read:
    /// `[panel, k / 256, 4, 8, 2]`, lane `l`'s `mn` of blocks `2t` and `2t + 1` of the 256); per 256, `d` and the min's
    /// scale negated, `-dmin`, as the file's f16 bits (`[panel, k / 256, 8]`); weight = `d * sc * q - dmin * mn`:
    /// 4.625 bits a weight (the file's 4.5, its 6-bit scales and mins packed). Its products take the
    /// activations quantized per 256 ([`Acts::supers`]): per 256, the exact integers `sum over the 8 blocks of sc *
    /// sum(q x)` (at most 8 x 63 x 32 x 15 x 127 < 2^25) and `sum of mn * sum(x)`, then two float steps, `acc =
    /// fma(sum, d_w * d_x, acc)`, `acc = fma(msum, -dmin_w * d_x, acc)`.
    K4 { qs: Vec<u8>, sc: Vec<u8>, mn: Vec<u8>, d: Vec<u16>, dmin: Vec<u16> },
    /// Q5_K as stored: its 5-bit codes one per byte, chunked as `U8`, and `K4`'s scales, mins, `d` and `-dmin`:
    /// weight = `d * sc * q - dmin * mn`, 8.6 bits a weight (the `U8` layout it had took 12). Its products are
    /// `K4`'s (`sum of sc x sum(q x)` at most 8 x 63 x 32 x 31 x 127 < 2^26). Held where the process takes the tile
    /// unit, whose int8 tiles read its bytes; elsewhere `K5N`.
    K5 { qs: Vec<u8>, sc: Vec<u8>, mn: Vec<u8>, d: Vec<u16>, dmin: Vec<u16> },
    /// Q5_K in the file's five bits a code: `K5`'s codes in 160 bytes per panel and block, not 256. Bytes `32 t..32 t
    /// + 32` (`t < 4`) hold `K5`'s chunk `t` in their low five bits and the low three bits of chunk `t + 4` above
    /// them; bytes `128..160` hold the two high bits of chunk `4 + t` at bits `2 t` and `2 t + 1` ([`k5n_code`]): a
    /// chunk comes back in one operation (`g < 4`) or five. `K5`'s scales, mins and products, so the same
    /// bits: 5.625 bits a weight (the file's 5.5). Products of more than 16 rows lay the codes out as `K5`'s bytes
    /// once for all the rows, as `Q6N`'s. Held where `Q6N` is ([`pack::narrow_codes`]).
    K5N { qs: Vec<u8>, sc: Vec<u8>, mn: Vec<u8>, d: Vec<u16>, dmin: Vec<u16> },
    /// IEEE half-precision bits.
    F16(Vec<u16>),
    /// bfloat16 bits.
    Bf16(Vec<u16>),
}

/// `Data::Q6`'s, `Data::Q6N`'s and `Data::K3`'s codes: bytes per panel and block, and the code standing for zero
/// (`q - 32`, `c - 4`).
fn signed_codes(data: &Data) -> (usize, i32) {
    match data {
        Data::K3 { .. } => (96, 4),
        Data::Q6N { .. } => (192, 32),
        _ => (256, 32),
    }
}

/// Code `at` (of 32: lane `at / 4`'s weight `at % 4`) of chunk `g` (of 8, `K5`'s order) of one panel and block of
/// [`Data::K5N`]'s (and [`Data::U5`]'s and [`Data::S5`]'s) 160 bytes: 0..=31.
fn k5n_code(block: &[u8], g: usize, at: usize) -> u8 {
    if g < 4 {
        block[32 * g + at] & 0x1F
    } else {
        let t = g - 4;
        block[32 * t + at] >> 5 | ((block[128 + at] >> (2 * t)) & 3) << 3
    }
}

/// A narrow layout's codes laid out as its wide layout's bytes before products of many rows (`Data::Q6N` as `Q6`,
/// `Data::K5N` as `K5`, `Data::U5` as `U8`, `Data::S5` as its codes a byte each): the narrow bytes per panel and
/// block, or `None` for the other layouts.
fn narrow_bytes(data: &Data) -> Option<(&[u8], usize)> {
    match data {
        Data::Q6N { qs, .. } => Some((qs, 192)),
        Data::K5N { qs, .. } | Data::U5 { qs, .. } | Data::S5 { qs, .. } => Some((qs, 160)),
        _ => None,
    }
}

/// An f16's bits as f32 (exact): the scales held as the file's f16 (`Data::Q4`, `S8`, `S5`, `K4`, `K5`, `K5N`).
fn half_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Code `at` (of 32: lane `at / 4`'s weight `at % 4`) of chunk `g` (of 8) of one panel and block of [`Data::Q6N`]'s
/// 192 bytes: 0..=63.
fn q6n_code(block: &[u8], g: usize, at: usize) -> u8 {
    if g < 4 {
        block[32 * g + at] & 0x3F
    } else {
        let t = g - 4;
        (block[32 * t + at] >> 6) << 4 | (block[128 + 32 * (t / 2) + at] >> (4 * (t % 2))) & 0xF
    }
}

/// Code `at` (of 32: lane `at / 4`'s weight `at % 4`) of chunk `g` (of 8) of one panel and block of [`Data::K3`]'s 96
/// bytes: 0..=7.
fn k3_code(block: &[u8], g: usize, at: usize) -> u8 {
    ((block[32 * (g / 4) + at] >> (2 * (g % 4))) & 3) | ((block[64 + at] >> g) & 1) << 2
}

impl Packed {
    /// A GGUF matrix in the kernels' layout, or `None` for a type or width they do not take.
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Option<Packed>> {
        let (n, k) = t.shape().dims2()?;
        let bytes = t.data()?;
        pack::pack(t.dtype(), &bytes, n, k).map_err(candle_core::Error::Msg)
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn columns(&self) -> usize {
        self.k
    }

    pub fn stored_dtype(&self) -> GgmlDType {
        self.stored
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.data {
            Data::Q4 { qs, d, m } => qs.len() + 2 * (d.len() + m.len()),
            Data::U8 { qs, d, m } | Data::U5 { qs, d, m } => qs.len() + 4 * (d.len() + m.len()),
            Data::S8 { qs, d, .. } | Data::S5 { qs, d } => qs.len() + 2 * d.len(),
            Data::Q6 { qs, sc, d } | Data::Q6N { qs, sc, d } | Data::K3 { qs, sc, d } => qs.len() + sc.len() + 4 * d.len(),
            Data::K4 { qs, sc, mn, d, dmin } | Data::K5 { qs, sc, mn, d, dmin } | Data::K5N { qs, sc, mn, d, dmin } => qs.len() + sc.len() + mn.len() + 2 * (d.len() + dmin.len()),
            Data::F16(w) | Data::Bf16(w) => 2 * w.len(),
        }
    }

    /// The weights as f32, `[n * k]` row-major: what every product computes with.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        for (row, out) in out.chunks_exact_mut(self.k.max(1)).enumerate() {
            self.dequantize_row(row, out);
        }
        out
    }

    /// Row `row`'s weights as f32 into `out` (`k` of them): [`Packed::dequantize`]'s row. A tied embedding table
    /// looks its rows up here, held once with the output projection ([`crate::engine::models`]'s `Embedding`).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.n && out.len() == self.k, "row {row} of a [{}, {}] matrix into {} values (a bug)", self.n, self.k, out.len());
        let (blocks, p, l) = (self.k / 32, row / PANEL, row % PANEL);
        let k = self.k;
        // Column `col`'s block in this row's panel, and its place in the block.
        let at = |col: usize| (p * blocks + col / 32, col % 32);
        match &self.data {
            Data::Q4 { qs, d, m } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    let byte = qs[pb * 128 + 32 * (i % 16 / 4) + 4 * l + i % 4];
                    let code = if i < 16 { byte & 0xF } else { byte >> 4 };
                    let d = half_f32(d[pb * PANEL + l]);
                    *o = if m.is_empty() { d * (code as i32 - 8) as f32 } else { d * code as f32 + half_f32(m[pb * PANEL + l]) };
                }
            }
            Data::U8 { qs, d, m } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    let at = (2 * pb + i / 16) * PANEL + l;
                    *o = d[at] * qs[pb * 256 + 32 * (i / 4) + 4 * l + i % 4] as f32 + m[at];
                }
            }
            Data::U5 { qs, d, m } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    let code = k5n_code(&qs[pb * 160..(pb + 1) * 160], i / 4, 4 * l + i % 4);
                    *o = d[pb * PANEL + l] * code as f32 + m[pb * PANEL + l];
                }
            }
            Data::S8 { qs, d, .. } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    *o = half_f32(d[pb * PANEL + l]) * (qs[pb * 256 + 32 * (i / 4) + 4 * l + i % 4] ^ 0x80) as i8 as f32;
                }
            }
            Data::S5 { qs, d } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    let q = k5n_code(&qs[pb * 160..(pb + 1) * 160], i / 4, 4 * l + i % 4) as i32 - 16;
                    *o = half_f32(d[pb * PANEL + l]) * q as f32;
                }
            }
            Data::Q6 { qs, sc, d } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    let q = qs[pb * 256 + 32 * (i / 4) + 4 * l + i % 4] as i32 - 32;
                    // ggml's order, `(d * sc) * (q - 32)`: `d * sc` is exact in f32 (11 and 8 significant bits), so
                    // the weight is the exact product rounded once, and a zero takes the sign ggml gives it.
                    *o = d[(p * (blocks / 8) + col / 256) * PANEL + l] * sc[(2 * pb + i / 16) * PANEL + l] as f32 * q as f32;
                }
            }
            Data::Q6N { qs, sc, d } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    let q = q6n_code(&qs[pb * 192..(pb + 1) * 192], i / 4, 4 * l + i % 4) as i32 - 32;
                    // As `Q6`'s.
                    *o = d[(p * (blocks / 8) + col / 256) * PANEL + l] * sc[(2 * pb + i / 16) * PANEL + l] as f32 * q as f32;
                }
            }
            Data::K3 { qs, sc, d } => {
                for (col, o) in out.iter_mut().enumerate() {
                    let (pb, i) = at(col);
                    let q = k3_code(&qs[pb * 96..(pb + 1) * 96], i / 4, 4 * l + i % 4) as i32 - 4;
                    // ggml's order, `(d * sc) * (c - 4)`: exact in f32 (at most 11 + 6 + 3 significant bits).
                    *o = d[(p * (blocks / 8) + col / 256) * PANEL + l] * sc[(2 * pb + i / 16) * PANEL + l] as f32 * q as f32;
                }
            }
            Data::K4 { qs, sc, mn, d, dmin } | Data::K5 { qs, sc, mn, d, dmin } | Data::K5N { qs, sc, mn, d, dmin } => {
                let (wide, five) = (matches!(self.data, Data::K5 { .. }), matches!(self.data, Data::K5N { .. }));
                for (col, o) in out.iter_mut().enumerate() {
                    let ((pb, i), b) = (at(col), col / 32);
                    let code = if five {
                        k5n_code(&qs[pb * 160..(pb + 1) * 160], i / 4, 4 * l + i % 4)
                    } else if wide {
                        qs[pb * 256 + 32 * (i / 4) + 4 * l + i % 4]
                    } else {
                        let byte = qs[pb * 128 + 32 * (i % 16 / 4) + 4 * l + i % 4];
                        if i < 16 { byte & 0xF } else { byte >> 4 }
                    };
                    let ps = (p * (blocks / 8) + b / 8) * PANEL + l;
                    let min = mn[((p * (blocks / 8) + b / 8) * 4 + b % 8 / 2) * 16 + 2 * l + b % 2];
                    // ggml's order, `(d * sc) * q - dmin * mn` (`dmin` is held negated): both products are exact in
                    // f32 (at most 11 + 6 + 5 and 11 + 6 significant bits), the sum rounded once.
                    *o = half_f32(d[ps]) * sc[pb * PANEL + l] as f32 * code as f32 + half_f32(dmin[ps]) * min as f32;
                }
            }
            Data::F16(w) => {
                for (o, &bits) in out.iter_mut().zip(&w[row * k..(row + 1) * k]) {
                    *o = half::f16::from_bits(bits).to_f32();
                }
            }
            Data::Bf16(w) => {
                for (o, &bits) in out.iter_mut().zip(&w[row * k..(row + 1) * k]) {
                    *o = half::bf16::from_bits(bits).to_f32();
                }
            }
        }
    }

    /// 4-bit codes standing for `d * (code - 8)` (`Data::Q4` without offsets).
    fn signed4(&self) -> bool {
        matches!(&self.data, Data::Q4 { m, .. } if m.is_empty())
    }

    fn quantized(&self) -> bool {
        !matches!(self.quant(), Quant::Float | Quant::Bf16)
    }

    /// How the products quantize the activations for this matrix.
    fn quant(&self) -> Quant {
        match self.data {
            Data::F16(_) => Quant::Float,
            Data::Bf16(_) => Quant::Bf16,
            Data::K4 { .. } | Data::K5 { .. } | Data::K5N { .. } | Data::Q6 { .. } | Data::Q6N { .. } | Data::K3 { .. } => Quant::Supers,
            _ => Quant::Blocks,
        }
    }

    /// `x · Wᵀ` for `x` `[m, k]` row-major: `[m, n]` row-major, at the [`Level::active`] level.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_at(Level::active(), x, m)
    }

    /// [`Packed::matmul`] at a given level (one the CPU has: [`Level::available`]).
    pub fn matmul_at(&self, level: Level, x: &[f32], m: usize) -> Vec<f32> {
        matmul_many(level, &[self], x, m).pop().expect("one output per matrix")
    }
}

/// How a product's activations are quantized: not at all (F16 weights; bf16 weights, whose activations the
/// AVX-512 BF16 and AMX levels round to bf16, so that a product of several matrices rounds them for all or none),
/// per block of 32 with llama.cpp's `Q8_0`/`Q8_1` rounding (the types with scales per 32 or 16), or per 256 with its
/// `Q8_K` rounding (the k-quants whose scales are small integers under one float scale per 256: their products sum
/// whole 256s in integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Quant {
    Float,
    Bf16,
    Blocks,
    Supers,
}

/// Activation rows, as the kernels read them: the f32 values, and for quantized weights their 8-bit codes.
struct Acts<'a> {
    k: usize,
    f32: &'a [f32],
    /// Quantized per 256 ([`Quant::Supers`]): `d` per 256 (`[m, k / 256]`), `sums16` and `bsums` set, `s32`, `s16`
    /// and `sums` empty.
    supers: bool,
    /// Codes, `[m, k]`, in -127..=127.
    qs: Vec<i8>,
    /// Scale per block of 32, `[m, k / 32]` (per 256 for `supers`).
    d: Vec<f32>,
    /// For `supers`, the sum of the codes per block of 32, `[m, k / 32]` (at most 32 x 127 in magnitude).
    bsums: Vec<i16>,
    /// `d * (sum of the codes)` per block of 32 (`[m, k / 32]`) and per group of 16 (`[m, k / 16]`).
    s32: Vec<f32>,
    s16: Vec<f32>,
    /// The sum of the codes per block of 32, exact (`[m, k / 32]`).
    sums: Vec<i32>,
    /// For `supers`, the sum of the codes per group of 16, exact (`[m, k / 16]`: Q6_K's `32 x sum(x)`).
    sums16: Vec<i32>,
    /// For the AMX level, the same activations in the tile unit's order (empty at the other levels).
    tiles: TileOrder,
    /// For the AMX level's bf16 tiles, the activations (already rounded to bf16, `f32` holds their values) as bf16
    /// bits in the tile unit's order: `[⌈m / 16⌉, ⌈k / 32⌉, 16, 32]`, zero past the last row and column. Empty
    /// unless every matrix of the product is bf16 and it has at least [`BF16_TILE_ROWS`] rows. For the F16 tiles
    /// ([`F16_TILE_ROWS`] rows or more of F16 matrices), the f32 activations split in two, [`split_tile_order`]'s.
    bf16: Vec<u16>,
    /// For the AVX-512 BF16 level's products of bf16 matrices, the activations rounded to bf16 (to nearest, ties
    /// to even), row by row, each row padded with zeros to a multiple of 32 values (`[m, ⌈k / 32⌉ · 32]`); empty
    /// otherwise.
    bf16_rows: Vec<u16>,
}

/// The activations as the AMX kernels read them, arranged once per product: the codes per 16 rows and block, the
/// 16 rows' 32 codes side by side (`[m / 16, k / 32, 16, 32]`; whole tiles of rows only), so that a tile loads 512
/// contiguous bytes; and the scales and sums by block (or group of 16), then row (`[k / 32, m]`, `s16` `[k / 16,
/// m]`), so that the float steps broadcast a row's value straight from memory. Quantized per 256 (`Acts::supers`),
/// the codes per 16 rows and 64 columns (`[m / 16, k / 64, 16, 64]`: a whole tile's width) and `d` `[k / 256, m]`.
#[derive(Default)]
struct TileOrder {
    /// The codes from `start` (see [`TileOrder::codes`]).
    buffer: Vec<i8>,
    /// Where the codes start in `buffer`: its first 64-byte boundary. A tile load's rows of 64 (or 32) bytes then
    /// each lie in one cache line; from the heap's 16-byte alignment half or all of them straddled two, and the tile
    /// loop ran 10-25 % slower (`scripts/amx-probe.c`-style probe, 2-core Sapphire Rapids).
    start: usize,
    d: Vec<f32>,
    s32: Vec<f32>,
    s16: Vec<f32>,
}

impl TileOrder {
    /// The codes, `[m / 16, k / width, 16, width]`, their first byte on a 64-byte boundary.
    fn codes(&self) -> &[i8] {
        &self.buffer[self.start..]
    }

    fn new(acts: &Acts) -> TileOrder {
        let (k, m) = (acts.k, acts.rows());
        let blocks = k / 32;
        // A tile's width of codes: 32 (a block), or 64 (the whole width) per 256.
        let width = if acts.supers { 64 } else { 32 };
        // Tiles of rows in parallel (a prefill's are megabytes: on one thread, and zeroed first, they took 2 % of
        // it), written straight into the buffer's capacity.
        let len = m / 16 * 16 * k;
        assert!(acts.qs.len() >= len && k.is_multiple_of(width), "activation codes (a bug)");
        let mut codes: Vec<i8> = Vec::with_capacity(len + 63);
        let start = codes.as_ptr().align_offset(64);
        assert!(start < 64, "alignment of a byte buffer (a bug)");
        let arrange = |(t, rows): (usize, &mut [std::mem::MaybeUninit<i8>])| {
            for (b, block) in rows.chunks_exact_mut(16 * width).enumerate() {
                for (i, codes) in block.chunks_exact_mut(width).enumerate() {
                    let at = (16 * t + i) * k + width * b;
                    let from = &acts.qs[at..at + width];
                    // SAFETY: `codes` is `width` elements of the buffer's capacity and `from` `width` initialised
                    // codes of another buffer; `MaybeUninit<i8>` has `i8`'s layout.
                    unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), codes.as_mut_ptr().cast::<i8>(), width) };
                }
            }
        };
        let spare = &mut codes.spare_capacity_mut()[start..start + len];
        if m >= 64 {
            spare.par_chunks_exact_mut(16 * k).enumerate().for_each(arrange);
        } else {
            spare.chunks_exact_mut(16 * k).enumerate().for_each(arrange);
        }
        // The bytes before the boundary, zero (never read as codes).
        for b in &mut codes.spare_capacity_mut()[..start] {
            b.write(0);
        }
        // SAFETY: the capacity is at least `start + len`, and every element below it was written above: the first
        // `start` zeros, then the codes, whose chunks of `16 k` are the `m / 16` tiles, each tile's chunks of `16
        // width` its `k / width` blocks (`k` a multiple of `width`), and each block's chunks of `width` its 16 rows,
        // every one copied.
        unsafe { codes.set_len(start + len) };
        let by_block = |v: &[f32], per_row: usize| (0..per_row * m).map(|i| v[(i % m) * per_row + i / m]).collect();
        if acts.supers {
            return TileOrder { buffer: codes, start, d: by_block(&acts.d, k / 256), s32: Vec::new(), s16: Vec::new() };
        }
        TileOrder {
            buffer: codes,
            start,
            d: by_block(&acts.d, blocks),
            s32: by_block(&acts.s32, blocks),
            s16: by_block(&acts.s16, 2 * blocks),
        }
    }
}

impl<'a> Acts<'a> {
    fn new(level: Level, x: &'a [f32], k: usize, quant: Quant) -> Acts<'a> {
        let supers = quant == Quant::Supers;
        let mut acts = Acts { k, f32: x, supers, qs: Vec::new(), d: Vec::new(), bsums: Vec::new(), s32: Vec::new(), s16: Vec::new(), sums: Vec::new(), sums16: Vec::new(), tiles: TileOrder::default(), bf16: Vec::new(), bf16_rows: Vec::new() };
        if supers {
            assert!(k.is_multiple_of(256), "activations per 256 of width {k} (a bug)");
            let (n, blocks) = (x.len() / 256, x.len() / 32);
            acts.qs = vec![0; x.len()];
            acts.d = vec![0.0; n];
            acts.bsums = vec![0; blocks];
            acts.sums16 = vec![0; 2 * blocks];
            // In parallel for many rows, as below.
            const CHUNK: usize = 64;
            if n <= CHUNK {
                quantize_supers(level, x, &mut acts.qs, &mut acts.d, &mut acts.bsums, &mut acts.sums16);
            } else {
                let sums = acts.bsums.par_chunks_mut(8 * CHUNK).zip(acts.sums16.par_chunks_mut(16 * CHUNK));
                let codes = x.par_chunks(256 * CHUNK).zip(acts.qs.par_chunks_mut(256 * CHUNK)).zip(acts.d.par_chunks_mut(CHUNK));
                codes.zip(sums).for_each(|(((x, qs), d), (bsums, sums16))| quantize_supers(level, x, qs, d, bsums, sums16));
            }
            if level == Level::Amx {
                acts.tiles = TileOrder::new(&acts);
            }
        } else if quant == Quant::Blocks {
            debug_assert_eq!(k % 32, 0);
            let blocks = x.len() / 32;
            acts.qs = vec![0; x.len()];
            acts.d = vec![0.0; blocks];
            acts.s32 = vec![0.0; blocks];
            acts.s16 = vec![0.0; 2 * blocks];
            acts.sums = vec![0; blocks];
            // In parallel for many rows (prefill); a few rows are quicker on the calling thread.
            const CHUNK: usize = 512;
            if blocks <= CHUNK {
                quantize_blocks(level, x, &mut acts.qs, &mut acts.d, &mut acts.s32, &mut acts.s16, &mut acts.sums);
            } else {
                let sums = acts.s32.par_chunks_mut(CHUNK).zip(acts.s16.par_chunks_mut(2 * CHUNK)).zip(acts.sums.par_chunks_mut(CHUNK));
                let codes = x.par_chunks(32 * CHUNK).zip(acts.qs.par_chunks_mut(32 * CHUNK)).zip(acts.d.par_chunks_mut(CHUNK));
                codes.zip(sums).for_each(|(((x, qs), d), ((s32, s16), sums))| quantize_blocks(level, x, qs, d, s32, s16, sums));
            }
            if level == Level::Amx {
                acts.tiles = TileOrder::new(&acts);
            }
        }
        acts
    }

    fn rows(&self) -> usize {
        self.f32.len() / self.k
    }
}

/// A block's scale and its codes' scaled sums, as llama.cpp stores them for the same products (`block_q8_0`,
/// `block_q8_1`): the codes are rounded with the exact scale, the scale kept to f16 precision, the sums (per 32
/// and per 16) computed with the exact scale and kept to f16 precision. The products then see the activations
/// llama.cpp's do, and a model's outputs agree with llama.cpp's as closely as its weights allow.
fn store_scales(scale: f32, sums: [i32; 2], d: &mut f32, s32: &mut f32, s16: &mut [f32], sum: &mut i32) {
    *sum = sums[0] + sums[1];
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    *d = f16(scale);
    *s32 = f16(scale * (sums[0] + sums[1]) as f32);
    s16[0] = f16(scale * sums[0] as f32);
    s16[1] = f16(scale * sums[1] as f32);
}

/// Activations to codes per 256 as llama.cpp's `quantize_row_q8_K` rounds them: the value of largest magnitude
/// `max` (the first such), `iscale = -127 / max`, codes `min(127, round(iscale x))` (ties to even), scale `1 /
/// iscale`; and the exact code sums per 32 and per 16.
fn quantize_supers(level: Level, x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16], sums16: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    return x86::quantize_supers(level, x, qs, d, bsums, sums16);
    #[allow(unreachable_code)]
    {
        let _ = level;
        portable::quantize_supers(x, qs, d, bsums, sums16)
    }
}

fn quantize_blocks(level: Level, x: &[f32], qs: &mut [i8], d: &mut [f32], s32: &mut [f32], s16: &mut [f32], sums: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    return x86::quantize_blocks(level, x, qs, d, s32, s16, sums);
    #[allow(unreachable_code)]
    portable::quantize_blocks(x, qs, d, s32, s16, sums)
}

/// Where the kernels write: `[m, n]` row-major f32.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    n: usize,
    len: usize,
}

// SAFETY: `Out` is a raw view of one output buffer shared by the tasks of one parallel product. Each task writes
// only the columns of its own weight rows (`write` at `(row, n)` for `n` in the task's range, never read back), so
// no two threads touch the same element, and the buffer outlives the parallel region that holds the copies.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    fn write(self, row: usize, n: usize, value: f32) {
        let at = row * self.n + n;
        assert!(n < self.n && at < self.len, "kernel output ({row}, {n}) outside [{}, {}] (a bug)", self.len / self.n, self.n);
        // SAFETY: in bounds (checked above); no other task writes this element (see the `Send` impl).
        unsafe { *self.ptr.add(at) = value };
    }

    /// The outputs of a panel's eight weight rows `n0..n0 + 8` for activation row `row`: those below `n` (the
    /// rest are the panel's padding).
    fn write_lanes(self, row: usize, n0: usize, values: &[f32; PANEL]) {
        let count = PANEL.min(self.n.saturating_sub(n0));
        let at = row * self.n + n0;
        assert!(count > 0 && at + count <= self.len, "kernel output ({row}, {n0}..) outside [{}, {}] (a bug)", self.len / self.n, self.n);
        // SAFETY: `at..at + count` is in bounds (checked above) and within row `row`'s columns `n0..n`; no other
        // task writes them (see the `Send` impl), and `values` is a separate local array.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr.add(at), count) };
    }

    /// Asks for the line holding output `(row, n0)` to be brought into the L1 cache, for writing (`prefetchw`),
    /// where the output has that element: so that the stores that come later find it there instead of waiting
    /// on memory.
    #[inline(always)]
    fn prefetch_write(self, row: usize, n0: usize) {
        #[cfg(target_arch = "x86_64")]
        if n0 < self.n && row * self.n + n0 < self.len {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
            // SAFETY: the element is in bounds (checked above); a prefetch only hints the cache, reads nothing into
            // the program and writes nothing.
            unsafe { _mm_prefetch::<_MM_HINT_ET0>(self.ptr.add(row * self.n + n0).cast::<i8>()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (row, n0);
    }

    /// The outputs of columns `n0..n0 + W` for activation rows `r0..r0 + R`, when every one of them is an output:
    /// stored by `store(row, at)`, `at` where the row's `W` floats go (one wide vector store a row, where
    /// [`Out::store_tile`] hands eight floats at a time). Returns false, storing nothing, when a column there is
    /// past `n` (a panel's padding).
    #[inline(always)]
    fn store_rows<const W: usize, const R: usize>(self, n0: usize, r0: usize, mut store: impl FnMut(usize, *mut f32)) -> bool {
        if n0 + W > self.n {
            return false;
        }
        assert!((r0 + R) * self.n <= self.len, "kernel output rows {r0}..{} outside [{}, {}] (a bug)", r0 + R, self.len / self.n, self.n);
        for i in 0..R {
            // SAFETY: row `r0 + i` < `len / n` and columns `n0..n0 + W` <= `n` (checked above), so the `W` floats
            // are in bounds; no other task writes them (see the `Send` impl).
            store(i, unsafe { self.ptr.add((r0 + i) * self.n + n0) });
        }
        true
    }

    /// The outputs of panels `p0..p0 + P` for activation rows `r0..r0 + R`, when every one of them is an output
    /// (no panel padding among them): stored by `store(panel, row, at)`, `at` where its eight floats go. For
    /// vector stores, where [`Out::write_lanes`]'s copy of a variable count is a call to `memcpy` (measured at 5 %
    /// of a prefill). Returns false, storing nothing, when a panel there has padding.
    #[inline(always)]
    fn store_tile<const P: usize, const R: usize>(self, p0: usize, r0: usize, mut store: impl FnMut(usize, usize, *mut f32)) -> bool {
        if (p0 + P) * PANEL > self.n {
            return false;
        }
        assert!((r0 + R) * self.n <= self.len, "kernel output rows {r0}..{} outside [{}, {}] (a bug)", r0 + R, self.len / self.n, self.n);
        for j in 0..P {
            for i in 0..R {
                // SAFETY: row `r0 + i` < `len / n` and columns `(p0 + j) * 8..+ 8` <= `n` (checked above), so the
                // eight floats are in bounds; no other task writes them (see the `Send` impl).
                store(j, i, unsafe { self.ptr.add((r0 + i) * self.n + (p0 + j) * PANEL) });
            }
        }
        true
    }
}

/// Rows of one matrix one task computes.
struct Task {
    matrix: usize,
    rows: Range<usize>,
}

/// [`matmul_many`] over matrices of one width and any kinds: one call per kind of activations ([`Quant`]), the
/// products in the order of `weights`.
fn matmul_grouped(level: Level, weights: &[&Packed], x: &[f32], m: usize) -> Vec<Vec<f32>> {
    if weights.iter().all(|w| w.quant() == weights[0].quant()) {
        return matmul_many(level, weights, x, m);
    }
    let mut out = vec![Vec::new(); weights.len()];
    for kind in [Quant::Blocks, Quant::Supers, Quant::Float, Quant::Bf16] {
        let (at, group): (Vec<usize>, Vec<&Packed>) = weights.iter().enumerate().filter(|(_, w)| w.quant() == kind).map(|(i, w)| (i, *w)).unzip();
        if group.is_empty() {
            continue;
        }
        for (i, product) in at.into_iter().zip(matmul_many(level, &group, x, m)) {
            out[i] = product;
        }
    }
    out
}

/// `x · Wᵢᵀ` for each matrix (all `[_, k]` of the same kind of activations, [`Quant`]), the activations quantized
/// once, in one parallel region.
fn matmul_many(level: Level, weights: &[&Packed], x: &[f32], m: usize) -> Vec<Vec<f32>> {
    let k = weights[0].k;
    assert!(weights.iter().all(|w| w.k == k && w.quant() == weights[0].quant()), "matmul_many over matrices of different widths or kinds (a bug)");
    assert_eq!(x.len(), m * k, "activations are not [m, k] (a bug)");
    let level = level.min(Level::detected());
    // The AMX level's bf16 tiles and the AVX-512 BF16 level's dot products multiply bf16 by bf16: every row of a
    // product of bf16 matrices takes its activations rounded to bf16 (as llama.cpp's CPU products do for bf16
    // weights), whichever kernel computes it.
    let all_bf16 = weights[0].quant() == Quant::Bf16;
    #[cfg(target_arch = "x86_64")]
    let bf16_tiles = level == Level::Amx && all_bf16 && amx::bf16_granted();
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_tiles = false;
    let rounded: Vec<f32>;
    let x = if bf16_tiles {
        let round = |v: &f32| f32::from_bits(u32::from(round_bf16(*v)) << 16);
        // In parallel for many rows (prefill); a few rows are quicker on the calling thread, which hands a
        // parallel job to the pool and waits for it.
        rounded = if x.len() < PARALLEL_VALUES { x.iter().map(round).collect() } else { x.par_iter().with_min_len(PARALLEL_VALUES / 4).map(round).collect() };
        &rounded[..]
    } else {
        x
    };
    // F16 weights on the same tiles: each weight split exactly into two bf16 parts and each activation into two
    // (about 16 bits of it), three products (see `amx`). Fewer rows take the VNNI kernels' exact products.
    #[cfg(target_arch = "x86_64")]
    let f16_tiles = level == Level::Amx && m >= F16_TILE_ROWS && weights.iter().all(|w| matches!(w.data, Data::F16(_))) && amx::bf16_granted();
    #[cfg(not(target_arch = "x86_64"))]
    let f16_tiles = false;
    let mut acts = Acts::new(level, x, k, weights[0].quant());
    if level == Level::Avx512Bf16 && all_bf16 {
        acts.bf16_rows = bf16_rows(x, k);
    }
    if bf16_tiles && m >= BF16_TILE_ROWS {
        acts.bf16 = bf16_tile_order(x, m, k);
    } else if f16_tiles {
        acts.bf16 = split_tile_order(x, m, k);
    }
    // The outputs are written before they are read, so not zeroed first (zeroing them was 4 % of a prefill): the
    // kernels write into each buffer's capacity, and its length is set once all have run (below). Debug builds (the
    // tests) fill the capacity with `UNWRITTEN` first and check none is left.
    let mut outs: Vec<Vec<f32>> = weights.iter().map(|w| Vec::with_capacity(m * w.n)).collect();
    if cfg!(debug_assertions) {
        outs.iter_mut().for_each(|o| o.spare_capacity_mut().iter_mut().for_each(|v| _ = v.write(f32::from_bits(UNWRITTEN))));
    }
    let views: Vec<Out> = outs.iter_mut().zip(weights).map(|(o, w)| Out { ptr: o.as_mut_ptr(), n: w.n, len: m * w.n }).collect();
    // About eight tasks per thread over all the matrices' rows (two for a few activation rows, where each task is
    // short and hand-offs dominate; four at the AMX level, where each task configures the tiles and lays out its
    // first weights before the tile unit can start: 10-20 % faster at 16 rows on the 1B's matrices, the same at
    // 128), in multiples of 16 rows (whole panels); of 32 for the bf16 tiles, whose products take 32 weight rows at
    // a time.
    let total: usize = weights.iter().map(|w| w.n).sum();
    let unit = if acts.bf16.is_empty() { 16 } else { 32 };
    let per_task = total.div_ceil(rayon::current_num_threads() * if m <= 4 { 2 } else if level == Level::Amx { 4 } else { 8 }).next_multiple_of(unit).max(unit);
    let tasks: Vec<Task> = weights
        .iter()
        .enumerate()
        .flat_map(|(i, w)| (0..w.n).step_by(per_task).map(move |r| Task { matrix: i, rows: r..(r + per_task).min(w.n) }))
        .collect();
    let run = |t: &Task| run_rows(level, weights[t.matrix], t.rows.clone(), &acts, views[t.matrix]);
    if tasks.len() == 1 || m * total * k < 1 << 16 {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
    for (o, w) in outs.iter_mut().zip(weights) {
        // SAFETY: the capacity is `m * w.n` (allocated above), and every element of it is initialised: the tasks'
        // weight rows cover `0..w.n` (consecutive ranges from 0 to `w.n`, above), and `run_rows` writes every
        // output of its rows for every activation row (its contract: each level loops over all `m` activation rows,
        // and over every panel of the rows, writing each output once through `Out`). Every task has returned here (a
        // panic in one unwinds past this line, and the buffers are dropped with length 0). Debug builds check it.
        unsafe { o.set_len(m * w.n) };
        debug_assert!(o.iter().all(|v| v.to_bits() != UNWRITTEN), "a kernel left outputs unwritten (a bug)");
    }
    outs
}

/// What debug builds fill the kernels' output buffers with before the kernels run ([`matmul_many`]): a signalling
/// NaN, which no arithmetic produces (operations on NaNs give quiet ones), so an output still holding it was never
/// written.
const UNWRITTEN: u32 = 0x7f80_5a5a;

/// `v` rounded to bf16, to nearest with ties to even (a NaN stays a NaN): what the tile unit's and AVX-512 BF16's
/// bf16 products take.
fn round_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if v.is_nan() {
        return (u >> 16) as u16 | 0x40;
    }
    (u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16
}

/// Whether the kernels run the AMX level's bf16 tiles: at the AMX level, where the CPU has AMX-BF16
/// ([`Level::active`]'s, so after [`Level::choose`]). There products of bf16 matrices round their activations to
/// bf16, and products of F16 matrices (of [`F16_TILE_ROWS`] rows or more) split weights and activations into bf16
/// parts. Every other product computes the same bits at every level.
pub fn amx_bf16_tiles() -> bool {
    Level::active() == Level::Amx && amx_bf16_granted()
}

/// Whether the kernels run the AVX-512 BF16 level's dot products ([`Level::active`]'s, so after [`Level::choose`]):
/// there products of bf16 matrices round their activations to bf16. Every other product computes the same bits
/// as at the other levels.
pub fn avx512_bf16_dots() -> bool {
    Level::active() == Level::Avx512Bf16
}

/// Activations `[m, k]` rounded to bf16 ([`round_bf16`]), as [`Acts::bf16_rows`] holds them: each row padded with
/// zeros to a multiple of 32 values.
fn bf16_rows(x: &[f32], k: usize) -> Vec<u16> {
    let width = k.next_multiple_of(32);
    let mut rows = vec![0u16; x.len() / k * width];
    let round = |(from, to): (&[f32], &mut [u16])| to.iter_mut().zip(from).for_each(|(b, &v)| *b = round_bf16(v));
    // In parallel for many rows (prefill), as the AMX level's rounding.
    if x.len() < PARALLEL_VALUES {
        x.chunks_exact(k).zip(rows.chunks_exact_mut(width)).for_each(round);
    } else {
        x.par_chunks_exact(k).zip(rows.par_chunks_exact_mut(width)).with_min_len(PARALLEL_VALUES / 4 / k + 1).for_each(round);
    }
    rows
}

/// Whether the tile unit's bf16 products run in this process: the CPU has AMX-BF16 (and AVX-512 F, BW, VL and
/// VNNI) and Linux granted the tiles, whatever level is active (the attention's tiles, `attention::amx`).
pub fn amx_bf16_granted() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::bf16_granted();
    #[allow(unreachable_code)]
    false
}

/// `values` split into two bf16 parts each, `hi` to nearest (ties to even) and `lo` the rest to nearest, as
/// [`split_bf16`] does it, 32 at a time: what the tile unit's split products take (`attention::amx`).
///
/// # Safety
///
/// The CPU has AVX-512 F and BW (a safe call from code compiled with them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub fn split_bf16_parts(values: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    amx::split_acts(values, hi, lo);
}

/// The fewest activation rows a product of bf16 matrices takes the AMX level's tiles for (padded to 16): each task
/// lays its weights out as tiles first, and below 8 rows that costs more than the VNNI kernels' products
/// (`bench kernels`, BENCHMARKS.md); fewer rows take the VNNI kernels, on the same rounded activations.
const BF16_TILE_ROWS: usize = 8;

/// The fewest activation rows a product of F16 matrices takes the AMX level's tiles for (padded to 16): it lays out
/// two bf16 weight tiles per step and runs three products where bf16 runs one, so it pays from more rows than
/// bf16's [`BF16_TILE_ROWS`] (`bench kernels`, BENCHMARKS.md); fewer rows take the VNNI kernels' exact products.
const F16_TILE_ROWS: usize = 24;

/// `v` as two bf16 values, `hi` to nearest (ties to even) and `lo` the rest to nearest: `hi + lo` is within 2^-16
/// of `v` (bf16's unit roundoff squared), where `hi` alone is within 2^-8. A non-finite `v`'s `lo` is zero.
fn split_bf16(v: f32) -> (u16, u16) {
    let hi = round_bf16(v);
    let rest = v - f32::from_bits(u32::from(hi) << 16);
    (hi, if rest.is_finite() { round_bf16(rest) } else { 0 })
}

/// Activations `[m, k]` (f32) in the tile unit's order for the AMX level's F16 products, each value split in two
/// ([`split_bf16`]): per tile of 16 rows, the high parts' `⌈k / 32⌉` steps of `[16, 32]`, then the low parts'.
fn split_tile_order(x: &[f32], m: usize, k: usize) -> Vec<u16> {
    let steps = k.div_ceil(32);
    let mut out = vec![0u16; m.div_ceil(16) * 2 * steps * 512];
    let order = |(tile, rows): (&mut [u16], &[f32])| {
        let (hi, lo) = tile.split_at_mut(steps * 512);
        for (i, row) in rows.chunks_exact(k).enumerate() {
            for (s, values) in row.chunks(32).enumerate() {
                let at = s * 512 + i * 32;
                let (hi, lo) = (&mut hi[at..at + values.len()], &mut lo[at..at + values.len()]);
                // SAFETY: the tiles run only where the CPU has AVX-512 F and BW (`amx::granted`), and this order is
                // made only for them.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    amx::split_acts(values, hi, lo)
                };
                #[cfg(not(target_arch = "x86_64"))]
                for (j, &v) in values.iter().enumerate() {
                    (hi[j], lo[j]) = split_bf16(v);
                }
            }
        }
    };
    if x.len() < PARALLEL_VALUES {
        out.chunks_mut(2 * steps * 512).zip(x.chunks(16 * k)).for_each(order);
    } else {
        out.par_chunks_mut(2 * steps * 512).zip(x.par_chunks(16 * k)).for_each(order);
    }
    out
}

/// Activations at which the bf16 steps before a product (rounding, the tiles' order) go parallel.
const PARALLEL_VALUES: usize = 1 << 16;

/// Activations `[m, k]` (bf16 values) as bf16 bits in the tile unit's order, [`Acts::bf16`]'s.
fn bf16_tile_order(x: &[f32], m: usize, k: usize) -> Vec<u16> {
    let steps = k.div_ceil(32);
    let mut out = vec![0u16; m.div_ceil(16) * steps * 512];
    let order = |(tile, rows): (&mut [u16], &[f32])| {
        for (i, row) in rows.chunks_exact(k).enumerate() {
            for (s, values) in row.chunks(32).enumerate() {
                let at = s * 512 + i * 32;
                for (o, &v) in tile[at..at + values.len()].iter_mut().zip(values) {
                    // Exact: `v` is a bf16 value.
                    *o = (v.to_bits() >> 16) as u16;
                }
            }
        }
    };
    if x.len() < PARALLEL_VALUES {
        out.chunks_mut(steps * 512).zip(x.chunks(16 * k)).for_each(order);
    } else {
        out.par_chunks_mut(steps * 512).zip(x.par_chunks(16 * k)).for_each(order);
    }
    out
}

/// Weight rows (whole panels) per slice of a task: about 256 KiB of weights, which stay in the L2 cache while
/// every activation row passes over them.
fn l2_rows(w: &Packed) -> usize {
    // The narrow layouts' slices (`Data::Q6N`, `K5N`, `U5`, `S5`) are laid out as bytes, 256 for their 192 and 160,
    // before their products of several rows.
    let laid_out = narrow_bytes(&w.data).map_or(0, |(qs, per)| qs.len() / per * (256 - per));
    let per_row = (w.bytes() + laid_out).div_ceil(w.n.max(1)).max(1);
    ((256 << 10) / per_row).next_multiple_of(2 * PANEL).max(2 * PANEL)
}

/// Weight rows `rows` times every activation row.
///
/// Every level writes each output of `rows` for every activation row, once: [`matmul_many`] leaves its buffers
/// unzeroed and relies on it.
fn run_rows(level: Level, w: &Packed, rows: Range<usize>, x: &Acts, out: Out) {
    assert!(rows.end <= w.n && x.k == w.k && rows.start.is_multiple_of(PANEL), "kernel rows out of range (a bug)");
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Amx => amx::run_checked(w, rows, x, out),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512Bf16 if matches!(w.data, Data::Bf16(_)) => x86::run_bf16_dots(w, rows, x, out),
        #[cfg(target_arch = "x86_64")]
        Level::Vnni | Level::Avx512Bf16 => x86::run_vnni(w, rows, x, out),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => x86::run_avx2(w, rows, x, out),
        _ if w.quantized() => portable::run(w, rows, x, out),
        _ => portable::run_float(w, rows, x, out),
    }
}

/// The reduction every level ends with: eight lanes, halves added, then pairs, then the last two.
fn hsum8(a: [f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let t = [s[0] + s[2], s[1] + s[3]];
    t[0] + t[1]
}

/// A weight matrix as the model holds it: repacked for these kernels on the CPU, or candle's (other devices,
/// requantized layouts, types the kernels do not take).
pub enum Matrix {
    Candle(QMatMul),
    /// Shared (`Arc`) with a tied embedding table that looks its rows up in it.
    Packed(Arc<Packed>),
}

impl Matrix {
    /// The matrix for a device: packed on the CPU where the kernels take its type, candle's otherwise.
    pub fn new(t: QTensor, device: &Device) -> candle_core::Result<Matrix> {
        if device.is_cpu() {
            if let Some(p) = Packed::from_qtensor(&t)? {
                return Ok(Matrix::Packed(Arc::new(p)));
            }
        }
        Ok(Matrix::Candle(QMatMul::from_qtensor(t)?))
    }

    /// A dense bf16 or f16 matrix on the CPU (a Hugging Face checkpoint's, as stored) packed for the kernels'
    /// 16-bit path, which widens each weight exactly and takes the activations in f32; `None` for another dtype or a
    /// width the kernels do not take.
    pub fn packed_16bit(t: &Tensor) -> candle_core::Result<Option<Matrix>> {
        if !t.device().is_cpu() {
            return Ok(None);
        }
        let (n, k) = t.dims2()?;
        let (dtype, bits): (GgmlDType, Vec<u16>) = match t.dtype() {
            candle_core::DType::BF16 => (GgmlDType::BF16, t.flatten_all()?.to_vec1::<half::bf16>()?.into_iter().map(half::bf16::to_bits).collect()),
            candle_core::DType::F16 => (GgmlDType::F16, t.flatten_all()?.to_vec1::<half::f16>()?.into_iter().map(half::f16::to_bits).collect()),
            _ => return Ok(None),
        };
        let bytes: Vec<u8> = bits.into_iter().flat_map(u16::to_le_bytes).collect();
        Ok(pack::pack(dtype, &bytes, n, k).map_err(candle_core::Error::Msg)?.map(|p| Matrix::Packed(Arc::new(p))))
    }

    /// The matrix's columns, the width of the rows it multiplies.
    pub fn columns(&self) -> usize {
        match self {
            Matrix::Packed(p) => p.k,
            Matrix::Candle(QMatMul::QTensor(t)) => t.shape().dims().last().copied().unwrap_or(0),
            Matrix::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.dims().last().copied().unwrap_or(0),
        }
    }

    /// Bytes of weights held.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Packed(p) => p.bytes(),
            Matrix::Candle(QMatMul::QTensor(t)) => t.storage_size_in_bytes(),
            Matrix::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.elem_count() * t.dtype().size_in_bytes(),
        }
    }

    /// `x · Wᵀ` for `x` `[rows, k]` f32 on the CPU; `None` for a candle matrix (the caller uses candle).
    pub fn forward_packed(x: &Tensor, weights: &[&Matrix]) -> candle_core::Result<Option<Vec<Tensor>>> {
        let Some(packed) = Matrix::packed_group(weights) else { return Ok(None) };
        let (m, _) = x.dims2()?;
        let values = x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let outs = Matrix::products_host(&values, m, weights)?.expect("a packed group");
        outs.into_iter().zip(&packed).map(|(o, p)| Tensor::from_vec(o, (m, p.n), x.device())).collect::<candle_core::Result<_>>().map(Some)
    }

    /// The matrices as the kernels', when every one is packed and of one width (of any kinds: [`matmul_grouped`]).
    fn packed_group<'a>(weights: &[&'a Matrix]) -> Option<Vec<&'a Packed>> {
        let packed: Vec<&Packed> = weights.iter().map(|w| if let Matrix::Packed(p) = w { Some(&**p) } else { None }).collect::<Option<_>>()?;
        let first = packed.first()?;
        packed.iter().all(|p| p.k == first.k).then_some(packed)
    }

    /// `x · Wᵢᵀ` for each matrix, `x` `[m, k]` row-major f32 in host memory: `None` unless every matrix is packed
    /// and of one width. Matrices of one kind share one quantization of the activations and one parallel region;
    /// a mix (llama.cpp's Q4_K_M-style mixes keep some matrices, say `attn_v`, in F16 or Q8_0 beside Q4_1 ones)
    /// runs one region per kind, each product the same bits as alone.
    pub fn products_host(x: &[f32], m: usize, weights: &[&Matrix]) -> candle_core::Result<Option<Vec<Vec<f32>>>> {
        let Some(packed) = Matrix::packed_group(weights) else { return Ok(None) };
        if x.len() != m * packed[0].k {
            candle_core::bail!("{} activations are not {m} rows for a matrix of width {}", x.len(), packed[0].k);
        }
        Ok(Some(matmul_grouped(model_level(&packed, m), &packed, x, m)))
    }

    /// The gated feed-forward network `down · (act(gate · x) * (up · x))` for `x` `[rows, k]` f32 on the CPU, gate
    /// and up in one parallel region and the intermediate in host memory; `None` unless all three are packed
    /// matrices of matching shapes (the caller uses candle).
    pub fn ffn_packed(x: &Tensor, gate: &Matrix, up: &Matrix, down: &Matrix, act: elementwise::Activation) -> candle_core::Result<Option<Tensor>> {
        let Some([_, _, d]) = Matrix::ffn_parts(gate, up, down) else { return Ok(None) };
        let (m, _) = x.dims2()?;
        let values = x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let y = Matrix::ffn_host(&values, m, gate, up, down, act)?.expect("packed feed-forward matrices");
        Ok(Some(Tensor::from_vec(y, (m, d.n), x.device())?))
    }

    /// Gate, up and down as the kernels' when all three are packed and their shapes chain.
    fn ffn_parts<'a>(gate: &'a Matrix, up: &'a Matrix, down: &'a Matrix) -> Option<[&'a Packed; 3]> {
        let (Matrix::Packed(g), Matrix::Packed(u), Matrix::Packed(d)) = (gate, up, down) else { return None };
        (g.k == u.k && g.n == u.n && d.k == g.n).then_some([&**g, &**u, &**d])
    }

    /// [`Matrix::ffn_packed`] on host memory: `x` `[m, k]` row-major f32, the output `[m, down's rows]`; the
    /// gate's activation `act`.
    pub fn ffn_host(x: &[f32], m: usize, gate: &Matrix, up: &Matrix, down: &Matrix, act: elementwise::Activation) -> candle_core::Result<Option<Vec<f32>>> {
        let Some([g, u, d]) = Matrix::ffn_parts(gate, up, down) else { return Ok(None) };
        if x.len() != m * g.k {
            candle_core::bail!("{} activations are not {m} rows for a matrix of width {}", x.len(), g.k);
        }
        let [mut gated, up_out]: [Vec<f32>; 2] = matmul_grouped(model_level(&[g, u], m), &[g, u], x, m).try_into().expect("two outputs");
        elementwise::gated(act, &mut gated, &up_out);
        Ok(Some(matmul_many(model_level(&[d], m), &[d], &gated, m).pop().expect("one output")))
    }
}

#[cfg(test)]
mod tests;
