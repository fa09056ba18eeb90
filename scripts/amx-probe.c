// The cost of the AMX int8 kernel's two halves on this CPU, in core cycles per 16 x 16 x 32 tile product (one
// block of 32 for 16 activation rows by 16 weight rows): the tile unit's work (zero, product, store the sums), the
// float steps after it (per row: convert the sums, scale by d_w * d_x, add; add the offset's product), and both
// interleaved as `src/engine/kernels/amx.rs` runs them. Everything stays in the L1 cache: an upper bound on speed.
//
//   gcc -O2 -march=sapphirerapids -o /tmp/amx-probe scripts/amx-probe.c && /tmp/amx-probe
//
// (BENCHMARKS.md, 2026-12-06.) Linux grants the tile state only when asked (arch_prctl), as nightshift does.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t bytes[16]; uint8_t rows[16]; } config_t;

static int32_t sums[3][4][16][16] __attribute__((aligned(64)));
static float acc[4][16][16] __attribute__((aligned(64)));
static float xd[32] __attribute__((aligned(64)));
static int8_t A[4][16 * 32] __attribute__((aligned(64)));
static uint8_t B[4][8 * 64] __attribute__((aligned(64)));
static __m512 dw, mw;

// One tile product's float steps: what `finish` does per row.
static inline void finish(int q, int32_t (*s)[16]) {
    for (int r = 0; r < 16; r++) {
        __m512 a = _mm512_load_ps(acc[q][r]);
        __m512 d = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r]));
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s[r])), d, a);
        a = _mm512_fmadd_ps(mw, _mm512_set1_ps(xd[r + 16]), a);
        _mm512_store_ps(acc[q][r], a);
    }
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
        puts("Linux does not grant the tiles here");
        return 1;
    }
    // The core clock: a chain of dependent 3-cycle multiplies.
    long x = 3, n = 300000000;
    double t = seconds();
    for (long i = 0; i < n; i++) __asm__ volatile("imul %0, %0" : "+r"(x));
    double ghz = 3.0 * n / (seconds() - t) / 1e9;
    config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) c.bytes[i] = 64, c.rows[i] = 16;
    for (int i = 4; i < 6; i++) c.bytes[i] = 32, c.rows[i] = 16, c.bytes[i + 2] = 64, c.rows[i + 2] = 8;
    _tile_loadconfig(&c);
    for (int i = 0; i < 32; i++) xd[i] = 1.0f / (i + 1);
    dw = _mm512_set1_ps(1.0f);
    mw = _mm512_set1_ps(0.5f);
    const char *names[] = {"tile unit: zero, product, store", "float steps", "both, as amx.rs interleaves them"};
    printf("core clock %.2f GHz\n", ghz);
    for (int mode = 0; mode < 3; mode++) {
        long steps = 2000000;
        t = seconds();
        for (long i = 0; i < steps; i++) {
            int s = i & 1;
            _tile_loadd(4, A[i & 3], 32);
            _tile_loadd(6, B[i & 3], 64);
            _tile_loadd(7, B[(i + 1) & 3], 64);
            _tile_loadd(5, A[(i + 1) & 3], 32);
            if (mode != 1) {
                _tile_zero(0); _tile_dpbsud(0, 4, 6); _tile_stored(0, sums[s][0], 64);
                if (mode == 2) finish(0, sums[1 - s][0]);
                _tile_zero(1); _tile_dpbsud(1, 4, 7); _tile_stored(1, sums[s][1], 64);
                if (mode == 2) finish(1, sums[1 - s][1]);
                _tile_zero(2); _tile_dpbsud(2, 5, 6); _tile_stored(2, sums[s][2], 64);
                if (mode == 2) finish(2, sums[1 - s][2]);
                _tile_zero(3); _tile_dpbsud(3, 5, 7); _tile_stored(3, sums[s][3], 64);
                if (mode == 2) finish(3, sums[1 - s][3]);
            } else {
                for (int q = 0; q < 4; q++) finish(q, sums[1 - s][q]);
            }
        }
        double per = (seconds() - t) * ghz * 1e9 / steps / 4;
        printf("%-36s %6.1f cycles per product (%.0f int8 MACs per cycle)\n", names[mode], per, 16 * 16 * 32 / per);
    }
    _tile_release();
    return acc[0][0][0] == 12345.0f;
}
