/* Weight-only MXFP4 linear: y[t][o] = sum_i fp4[o][i] 2^(e[o][i / 32] - 127) x[t][i] (+ bias[o]) for
 * E2M1 codes (4 bits) with one E8M0 scale byte per output row and block of 32 inputs (OCP
 * microscaling, gpt-oss's experts), x and y in float32 or bfloat16 (kernels/mxfp4_weights.py).
 *
 * Panels (Mxfp4Weight): 16 output rows x I inputs (I a multiple of 32), (ceil(O / 16), G = I / 32, 16
 * pairs, 16 rows) bytes: byte o of pair j of block g = code[o][32g + 2j] | code[o][32g + 2j + 1] << 4,
 * the checkpoint's own bytes (`X_blocks` (O, G, 16): element 2j in the low nibble of byte j) moved,
 * never recoded; 256 bytes a panel and block. Scales (ceil(O / 16), G, 16) bytes: the 16 rows' E8M0
 * exponents of each block. Rows past O: code 0 (scale byte 127).
 *
 * Decoding in registers: 16 bytes (one pair of a panel, every lane one row) zero-extended to 32-bit
 * lanes index a 16-entry table of the FP4 values with vpermps (it reads each index's low 4 bits: the
 * low nibble, input 2j) and again after a shift by 4 (the high nibble, input 2j + 1). The 16 scale
 * bytes of a block become the float32 vector 2^(e - 127) by a shift into the exponent field (e = 0:
 * 2^-127, a subnormal, set apart). FP4 values times powers of two are exact in float32 and bf16, but
 * for values under 2^-126 (subnormals, which the BF16 dot products read as zero) and the overflow of
 * the largest codes at e >= 253.
 *
 * Kernels (`kernel`, kernels/int8.py's numbers; AVX-512 ones compiled with target attributes where the
 * compiler has them, run where the CPU lists their ISA):
 *  AVX2     as AVX512 below with 8 lanes (a pair is two halves of 8 rows) and tiles of up to 3 rows;
 *           vpermps there indexes 8 entries, so the table holds the 8 magnitudes and each nibble's
 *           sign bit is moved into the float's.
 *  AVX512   float32 x (bf16 x widened once into a copy): tiles of up to 8 rows; per block of 32
 *           inputs, each pair's two decoded vectors FMA against the rows' broadcast x values into
 *           float32 partial sums (lane = output row), then the partial sums times the block's 16
 *           row scales are added into the row's sums. Every product is one FMA: the result equals
 *           x.float() @ W^T up to float32 summation order.
 *  BF16DOT  bf16 x only: panels go two at a time (mx_rows_bf: a thread's panels in pairs, an odd
 *           last one alone) through mxfp4_panels.h's panels_mx: BF_CHUNK pairs at a time, the first
 *           tile of rows decodes them side by side into a bf16 copy with the scales folded in as it
 *           dots them (int8_panels.h's layout: 128 bytes a pair, lane o of each half = (w[o][2j],
 *           w[o][2j + 1]); exact, see above) and every other tile reads the copy (int8_panels.h's
 *           rows_bf: each broadcast x pair feeds both panels' AVX-512 BF16 dot products, float32
 *           accumulation), prefetching the next pair's codes into L2 as it goes.
 * OpenMP and blocking as int8_gemm.c: threads own ranges of panels (rows split too where panels are
 * fewer than threads), rows in blocks whose x stays in L2 while every panel streams past it once. */
#include "mxfp4_panels.h"
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MX_X_BLOCK_BYTES (1 << 20)

static inline __attribute__((always_inline)) void mx_tile256(const float *x, int64_t ldx, const int R,
                                                             const uint8_t *pw, const uint8_t *ps, int64_t G,
                                                             const float *bias, int nv, void *y, int64_t ldy,
                                                             int y_bf16) {
    __m256 sum[MAX_R2][2];
    mx_dot256(x, ldx, R, pw, ps, G, sum);
    float b[PANEL] = {0};
    if (bias) memcpy(b, bias, sizeof(float) * (size_t)nv);
    for (int r = 0; r < R; r++) {
        float v[PANEL];
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(v + 8 * h, _mm256_add_ps(sum[r][h], _mm256_loadu_ps(b + 8 * h)));
        if (y_bf16) {
            uint16_t *yr = (uint16_t *)y + r * ldy;
            if (nv == PANEL) store_bf8(yr, _mm256_loadu_ps(v)), store_bf8(yr + 8, _mm256_loadu_ps(v + 8));
            else for (int o = 0; o < nv; o++) yr[o] = to_bf(v[o]);
        } else {
            memcpy((float *)y + r * ldy, v, sizeof(float) * (size_t)nv);
        }
    }
}

static void tile_mx256(const void *x, int64_t ldx, int R, const uint8_t *pw, const uint8_t *ps, int64_t G,
                       const float *bias, int nv, void *y, int64_t ldy, int y_bf16) {
#define CALL(n) mx_tile256((const float *)x, ldx, n, pw, ps, G, bias, nv, y, ldy, y_bf16)
    BY_ROWS3(R, CALL)
#undef CALL
}

#ifdef HAVE_AVX512
AI512 void mx_tile512(const float *x, int64_t ldx, const int R, const uint8_t *pw, const uint8_t *ps, int64_t G,
                      const float *bias, int nv, void *y, int64_t ldy, int y_bf16) {
    __m512 sum[MAX_R512];
    mx_dot512(x, ldx, R, pw, ps, G, sum);
    for (int r = 0; r < R; r++) store16(sum[r], ONES, bias, nv, (char *)y + r * ldy * (y_bf16 ? 2 : 4), y_bf16);
}

T512 static void tile_mx512(const void *x, int64_t ldx, int R, const uint8_t *pw, const uint8_t *ps, int64_t G,
                            const float *bias, int nv, void *y, int64_t ldy, int y_bf16) {
#define CALL(n) mx_tile512((const float *)x, ldx, n, pw, ps, G, bias, nv, y, ldy, y_bf16)
    BY_ROWS(R, CALL)
#undef CALL
}
#endif

#ifdef HAVE_BF16DOT
/* BF16DOT, rows [t0, t1) (at most BF_ROWS) of bf16 x (rows I values apart) over output panels [lo, hi):
 * panels p and p + 1 decoded side by side into d a chunk of blocks at a time (BF_CHUNK pairs), an odd
 * last panel alone, every tile of rows reading the chunk (int8_panels.h's rows_bf) before the next one,
 * the sums kept in cb between chunks, then (+ bias) into y; the dots prefetch the next pair's codes, the last
 * pair's those of `after` (the thread's next block's first pair; NULL: none). */
TBF static void mx_rows_bf(const uint16_t *x, int64_t I, int64_t t0, int64_t t1, const uint8_t *panels,
                           const uint8_t *scales, const float *bias, int64_t O, int64_t lo, int64_t hi, void *y,
                           int y_bf16, const uint8_t *after, uint16_t *d, float *cb) {
    const int64_t G = I / MX_BLOCK, panel_bytes = G * MX_PANEL_BLOCK;
    const size_t ysize = y_bf16 ? 2 : 4;
    for (int64_t p = lo; p < hi; p += 2) {
        const int two = p + 1 < hi;
        const uint8_t *pw = panels + p * panel_bytes, *ps = scales + p * G * PANEL;
        const uint8_t *next = p + 2 < hi ? pw + 2 * panel_bytes : after;
        const int64_t next_panels = p + 2 < hi ? (hi - p - 2 < 2 ? hi - p - 2 : 2) : hi - lo < 2 ? hi - lo : 2;
        const int64_t lines = next ? next_panels * panel_bytes / 64 : 0;
        panels_mx((const uint32_t *)(x + t0 * I), I / 2, t1 - t0, pw, ps, two ? pw + panel_bytes : NULL,
                  ps + G * PANEL, G, d, (const char *)next, lines, cb, 32);
        for (int64_t q = p; q < p + 1 + two; q++) {
            const int nv = O - q * PANEL < PANEL ? (int)(O - q * PANEL) : PANEL;
            for (int64_t t = t0; t < t1; t++)
                store16(_mm512_load_ps(cb + (t - t0) * 32 + (q - p) * 16), ONES, bias ? bias + q * PANEL : NULL, nv,
                        (char *)y + (t * O + q * PANEL) * ysize, y_bf16);
        }
    }
}
#endif

/* x (T, I) float32 or bf16 (x_bf16), contiguous, I a multiple of 32; panels and scales as above (P =
 * ceil(O / 16)); bias: O float32 values or NULL; y (T, O) float32 or bf16 (y_bf16), contiguous.
 * kernel: AVX2, AVX512 or BF16DOT (bf16 x only). Returns 0; -1 if a buffer (the float32 copy of bf16 x, the
 * panels' bf16 copies) cannot be allocated; -2 for a kernel this build lacks, or I not a multiple of 32. */
int shuttle_mxfp4_linear(const void *x, int x_bf16, int64_t T, int64_t I, const uint8_t *panels,
                         const uint8_t *scales, const float *bias, int64_t O, void *y, int y_bf16, int nthreads,
                         int kernel) {
    const int dequant = kernel == KERNEL_BF16DOT;
    if (I % MX_BLOCK) return -2;
#ifndef HAVE_AVX512
    if (kernel == KERNEL_AVX512) return -2;
#endif
#ifdef HAVE_BF16DOT
    if (dequant && !x_bf16) return -2;
#else
    if (dequant) return -2;
#endif
    if (kernel != KERNEL_AVX2 && kernel != KERNEL_AVX512 && !dequant) return -2;
    const int64_t P = (O + PANEL - 1) / PANEL, G = I / MX_BLOCK;
    const int64_t max_r = kernel == KERNEL_AVX2 ? MAX_R2 : MAX_R512;
    if (T <= 0 || P == 0) return 0;
    const int64_t tiles = (T + max_r - 1) / max_r;
    if (nthreads > P * tiles) nthreads = (int)(P * tiles);
    if (passive_waits() && T * O * I < (1 << 23)) nthreads = 1; /* (as int8_gemm.c) */
    if (nthreads < 1) nthreads = 1;
    const size_t xsize = dequant ? 2 : 4;
    const int copy = !dequant && x_bf16; /* the FMA kernel reads float32 rows */
    void *xs = copy ? aligned_alloc(64, ((size_t)(T * I) * 4 + 63) / 64 * 64) : (void *)x;
#ifdef HAVE_BF16DOT
    /* BF16DOT: per thread a chunk of two panels' bf16 copies (mx_rows_bf), then BF_ROWS x 32 sums */
    const int64_t gch = mx_chunk_blocks(G);
    const size_t dq_bytes = dequant ? (size_t)gch * 16 * 128 + 4 * BF_ROWS * 32 : 0;
#else
    const size_t dq_bytes = 0;
#endif
    uint16_t *dq = dequant ? aligned_alloc(64, dq_bytes * (size_t)nthreads) : NULL;
    if (!xs || (dequant && !dq)) {
        if (copy) free(xs);
        free(dq);
        return -1;
    }
    int64_t block = MX_X_BLOCK_BYTES / (I * (int64_t)xsize) / max_r * max_r;
    if (block < max_r) block = max_r;
#ifdef HAVE_BF16DOT
    if (dequant && block > BF_ROWS) block = BF_ROWS;
#endif
    /* BF16DOT's threads own pairs of panels (two at a time side by side), the others single ones */
    const int64_t unit = dequant ? 2 : 1;
    #pragma omp parallel num_threads(nthreads)
    {
        if (copy) {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                const uint16_t *s = (const uint16_t *)x + t * I;
                float *d = (float *)xs + t * I;
                for (int64_t i = 0; i < I; i++) d[i] = bf16_to_f32(s[i]);
            }
        }
        const int th = omp_get_thread_num();
        uint16_t *my_dq = dq ? (uint16_t *)((char *)dq + dq_bytes * (size_t)th) : NULL;
        grid_share g;
        if (grid_share_of(th, omp_get_num_threads(), P, unit, T, max_r, &g)) {
            const int64_t p_lo = g.p_lo, p_hi = g.p_hi, t_lo = g.t_lo, t_hi = g.t_hi;
            for (int64_t t0 = t_lo; t0 < t_hi; t0 += block) {
                const int64_t t1 = t_hi - t0 < block ? t_hi : t0 + block, ntiles = (t1 - t0 + max_r - 1) / max_r;
#ifdef HAVE_BF16DOT
                if (dequant) {
                    const uint8_t *after = t1 < t_hi ? panels + p_lo * G * MX_PANEL_BLOCK : NULL;
                    float *cb = (float *)((char *)my_dq + dq_bytes - 4 * BF_ROWS * 32);
                    mx_rows_bf((const uint16_t *)xs, I, t0, t1, panels, scales, bias, O, p_lo, p_hi, y, y_bf16, after,
                               my_dq, cb);
                    continue;
                }
#endif
                for (int64_t p = p_lo; p < p_hi; p++) {
                    const int64_t o0 = p * PANEL;
                    const int nv = O - o0 < PANEL ? (int)(O - o0) : PANEL;
                    const uint8_t *pw = panels + p * G * MX_PANEL_BLOCK, *ps = scales + p * G * PANEL;
                    for (int64_t t = t0, ti = 0, n; t < t1; t += n, ti++) {
                        n = (t1 - t + (ntiles - ti) - 1) / (ntiles - ti); /* even tiles: 17 rows -> 6, 6, 5 */
                        void *yt = (char *)y + (t * O + o0) * (y_bf16 ? 2 : 4);
                        const void *xt = (const char *)xs + t * I * (int64_t)xsize;
                        const float *bt = bias ? bias + o0 : NULL;
#ifdef HAVE_AVX512
                        if (kernel == KERNEL_AVX512) {
                            tile_mx512(xt, I, (int)n, pw, ps, G, bt, nv, yt, O, y_bf16);
                            continue;
                        }
#endif
                        tile_mx256(xt, I, (int)n, pw, ps, G, bt, nv, yt, O, y_bf16);
                    }
                }
            }
        }
    }
    if (copy) free(xs);
    free(dq);
    return 0;
}
