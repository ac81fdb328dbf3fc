/* Weight-only INT8 (and FP8) linear: y[t][o] = scale[o] * sum_i q[o][i] x[t][i] (+ bias[o]) for int8
 * codes q with one float32 scale per output channel, x and y in float32 or bfloat16.
 *
 * The codes are dequantised in registers: 16 int8 codes are loaded, sign-extended to int32
 * (vpmovsxbd), converted to float32 and multiplied into float32 accumulators with FMA against the
 * float32 activations; each output's scale is applied once, to its finished sum. Each term is one
 * FMA (one rounding; for bf16 x the product q x is exact), so a result equals the float32 reference
 * x (q scale)^T up to summation order and where the scale's product is rounded (once per output
 * here, once per weight there).
 *
 * Weight panels (kernels/int8.py: quantize_int8): 16 output channels x the inputs padded to an even
 * count Ip, stored in pairs, (ceil(O / 16), Ip / 2, 16, 2): byte 2o + k of pair j is q[o][2j + k].
 * One pair of a panel is 32 bytes; widened it is two vectors of 16 lanes, lane 2o + k of the first
 * (outputs 0-7) and of the second (outputs 8-15). A row's x pair (x[2j], x[2j + 1]) is broadcast as
 * one 64-bit value, so lane 2o + k accumulates q[o][2j + k] x[2j + k]; the two lanes of an output
 * are added once at the end. Scales are padded to 16 per panel (rows past O: scale 1, codes 0).
 *
 * FP8 (shuttle_fp8_linear, kernels/fp8_weights.py): the same panels holding E4M3 codes, with one scale
 * per panel and block of input pairs (int8_panels.h: codes_fmt). The dots decode the codes exactly
 * and scale each block's partial sums; the epilogue then scales by 1. Every kernel below runs on
 * either format through the same driver (linear_panels); FP8 AMX needs blocks of whole k-steps.
 *
 * Kernels (`kernel` argument):
 *  AVX2     AVX2 + FMA (the flags the library is built with): tiles of up to 3 rows.
 *  AVX512   AVX-512 F/BW/VL (target attribute): tiles of up to 8 rows sharing each widened pair.
 *  BF16DOT  AVX-512 BF16, bf16 x only: panels go two at a time (linear_rows_bf: a thread's panels
 *           in pairs, an odd last one alone), dequantised once per row block side by side into a
 *           bf16 copy in L2 by the block's first row tile as it dots them (codes -127..127 are exact
 *           in bf16: 128 bytes per pair, pack_panels32's pair layout for 32 outputs); every other
 *           row tile multiplies the copy by x's bf16 pairs with dpbf16, each broadcast x pair
 *           feeding both panels (two products per lane and instruction, float32 accumulation;
 *           int8_panels.h's panels_bf): the widening is paid once per panel and row block instead
 *           of once per row tile. The dots prefetch the next pair's codes into L2 as they go.
 *  AMX      AMX-BF16, bf16 x only: the same bf16 copies, two panels at a time (32 outputs), are B
 *           tiles (16 pairs x 16 outputs x 2 values, 64-byte rows); blocks of 32 rows of x (copied,
 *           padded to 32 rows and to a multiple of 32 inputs) are the A tiles; 4 accumulator tiles.
 * OpenMP: threads own ranges of panels; where there are fewer panels than threads, the rows are
 * split too. Rows go in blocks whose x (about 1 MiB) stays in L2 while every panel streams past it
 * once (BF16DOT: blocks of at most BF_ROWS rows); a panel (16 Ip bytes, 32 Ip dequantised) stays in
 * L1/L2 while the block's row tiles read it.
 * The inner loops (each kernel's dot over a panel) are int8_panels.h's, shared with moe_int8.c. */
#include "int8_panels.h"
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define X_BLOCK_BYTES (1 << 20)

/* One tile of an FMA kernel: R rows of float32 x (rows ldx values apart, 2 * pairs values each) times
 * one panel's codes (bs: its FP8 block scales, bpairs pairs each); writes y rows (ldy values apart) at
 * the panel's first output, the sums times `scale` (+ bias): nv valid outputs, float32 or bf16. */
typedef void (*tile_fn)(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                        int64_t bpairs, const float *scale, const float *bias, int nv, void *y, int64_t ldy,
                        int y_bf16);

#ifdef HAVE_AVX512
AI512 void tile512(const float *x, int64_t ldx, const int R, const int8_t *pw, int64_t pairs, const int fp8,
                   const float *bs, int64_t bpairs, const float *scale, const float *bias, int nv, void *y,
                   int64_t ldy, int y_bf16) {
    __m512 sum[MAX_R512];
    dot512(x, ldx, R, pw, pairs, sum, fp8, bs, bpairs);
    for (int r = 0; r < R; r++) store16(sum[r], scale, bias, nv, (char *)y + r * ldy * (y_bf16 ? 2 : 4), y_bf16);
}

#define CALL(n) \
    tile512((const float *)x, ldx, n, (const int8_t *)pw, pairs, FP8, bs, bpairs, scale, bias, nv, y, ldy, y_bf16)
#define FP8 0
T512 static void tile_avx512(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                             int64_t bpairs, const float *scale, const float *bias, int nv, void *y, int64_t ldy,
                             int y_bf16) {
    BY_ROWS(R, CALL)
}
#undef FP8
#define FP8 1
T512 static void tile_avx512_fp8(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                                 int64_t bpairs, const float *scale, const float *bias, int nv, void *y, int64_t ldy,
                                 int y_bf16) {
    BY_ROWS(R, CALL)
}
#undef FP8
#undef CALL

#ifdef HAVE_BF16DOT
/* BF16DOT, rows [t0, t1) (at most BF_ROWS) of bf16 x (rows Ip values apart) over output panels [lo, hi):
 * panels p and p + 1 side by side through panels_bf (an odd last one alone) into cb, then scaled (+ bias)
 * into y; each pair's dots prefetch the next pair's codes, the last pair's those of `after` (the
 * thread's next block's first pair; NULL: none). */
TBF static void linear_rows_bf(const uint16_t *xs, int64_t Ip, int64_t t0, int64_t t1, const int8_t *panels,
                               const float *scales, const codes_fmt *f, const float *bias, int64_t O, int64_t lo,
                               int64_t hi, void *y, int y_bf16, const int8_t *after, uint16_t *d, float *cb) {
    const int64_t pairs = Ip / 2;
    const size_t ysize = y_bf16 ? 2 : 4;
    for (int64_t p = lo; p < hi; p += 2) {
        const int two = p + 1 < hi;
        const int8_t *pw = panels + p * pairs * 32, *next = p + 2 < hi ? pw + 2 * pairs * 32 : after;
        const int64_t next_panels = p + 2 < hi ? (hi - p - 2 < 2 ? hi - p - 2 : 2) : hi - lo < 2 ? hi - lo : 2;
        panels_bf((const uint32_t *)(xs + t0 * Ip), pairs, t1 - t0, pw, two ? pw + pairs * 32 : NULL, pairs, f,
                  panel_scales(f, scales, p), two ? panel_scales(f, scales, p + 1) : NULL, (const char *)next,
                  next ? next_panels * pairs / 2 : 0, d, cb, 32);
        for (int64_t q = p; q < p + 1 + two; q++) {
            const int nv = O - q * PANEL < PANEL ? (int)(O - q * PANEL) : PANEL;
            for (int64_t t = t0; t < t1; t++)
                store16(_mm512_load_ps(cb + (t - t0) * 32 + (q - p) * 16), out_scales(f, scales, q),
                        bias ? bias + q * PANEL : NULL, nv, (char *)y + (t * O + q * PANEL) * ysize, y_bf16);
        }
    }
}
#endif

#ifdef HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>
static int amx_ready;

/* Ask the kernel for AMX's tile state for this process (Linux 5.16+: arch_prctl; kernels/int8.py asks
 * only where /proc/cpuinfo lists amx_bf16 and amx_tile). Returns 1 if AMX can be used (by this file's
 * kernel and moe_int8.c's). */
int shuttle_int8_amx_init(void) {
    if (!amx_ready) amx_ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ready;
}

/* Whether shuttle_int8_amx_init has granted the tiles (no system call). */
int shuttle_int8_amx_ready(void) { return amx_ready; }

/* The AMX kernel: x bf16 (T, I) copied to rows of Ik = 32 * ceil(I / 32) values (zeros past I) and
 * T padded to a multiple of 32 rows, so every tile reads inside it; panels in pairs (32 outputs),
 * each dequantised once per row block into the thread's bf16 copy (zeros past the panel's pairs). */
TAMX static int linear_amx(const uint16_t *x, int64_t T, int64_t I, const int8_t *panels, const float *scales,
                           const codes_fmt *f, const float *bias, int64_t O, void *y, int y_bf16, int nthreads) {
    const int64_t P = (O + PANEL - 1) / PANEL, pairs = (I + 1) / 2, kb = (pairs + 15) / 16, Ik = kb * 32;
    const int64_t U = (P + 1) / 2, tiles = (T + AMX_ROWS - 1) / AMX_ROWS, Tp = tiles * AMX_ROWS;
    if (nthreads > U * tiles) nthreads = (int)(U * tiles);
    if (passive_waits() && T * O * I < (1 << 23)) nthreads = 1;
    if (nthreads < 1) nthreads = 1;
    const size_t panel_bytes = (size_t)kb * 16 * 64; /* one dequantised panel */
    uint16_t *xs = aligned_alloc(64, (size_t)(Tp * Ik) * 2);
    uint16_t *dq = aligned_alloc(64, 2 * panel_bytes * (size_t)nthreads);
    if (!xs || !dq) {
        free(xs), free(dq);
        return -1;
    }
    int64_t block = X_BLOCK_BYTES / (Ik * 2) / AMX_ROWS * AMX_ROWS;
    if (block < AMX_ROWS) block = AMX_ROWS;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < Tp; t++) {
            uint16_t *d = xs + t * Ik;
            const int64_t n = t < T ? I : 0;
            if (n) memcpy(d, x + t * I, 2 * (size_t)n);
            memset(d + n, 0, 2 * (size_t)(Ik - n));
        }
        float c[AMX_ROWS * 32] __attribute__((aligned(64)));
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t pg = U < nt ? U : nt, rg_all = nt / pg, rg = rg_all < tiles ? rg_all : tiles;
        uint16_t *d0 = (uint16_t *)((char *)dq + 2 * panel_bytes * (size_t)th), *d1 = (uint16_t *)((char *)d0 + panel_bytes);
        if (th < pg * rg) {
            const int64_t gp = th % pg, gr = th / pg;
            const int64_t u_lo = U * gp / pg, u_hi = U * (gp + 1) / pg;
            const int64_t t_lo = tiles * gr / rg * AMX_ROWS, t_end = tiles * (gr + 1) / rg * AMX_ROWS;
            const int64_t t_hi = t_end < T ? t_end : T;
            amx_begin();
            for (int64_t t0 = t_lo; t0 < t_hi; t0 += block) {
                const int64_t t1 = t_hi - t0 < block ? t_hi : t0 + block;
                for (int64_t u = u_lo; u < u_hi; u++) {
                    const int64_t p0 = 2 * u, p1 = 2 * u + 1;
                    const int nv0 = O - p0 * PANEL < PANEL ? (int)(O - p0 * PANEL) : PANEL;
                    const int nv1 = p1 < P ? (O - p1 * PANEL < PANEL ? (int)(O - p1 * PANEL) : PANEL) : 0;
                    dequant_tiles(panels + p0 * pairs * 32, pairs, kb, d0, f->fp8);
                    if (nv1) dequant_tiles(panels + p1 * pairs * 32, pairs, kb, d1, f->fp8);
                    const float *bs0 = panel_scales(f, scales, p0), *bs1 = nv1 ? panel_scales(f, scales, p1) : bs0;
                    for (int64_t t = t0; t < t1; t += AMX_ROWS) {
                        const int n = t1 - t < AMX_ROWS ? (int)(t1 - t) : AMX_ROWS;
                        const uint16_t *b1 = nv1 ? d1 : d0;
                        if (f->fp8) amx_block_fp8(xs + t * Ik, Ik * 2, d0, b1, kb, n > 16, c, f->bpairs / 16, bs0, bs1);
                        else amx_block(xs + t * Ik, Ik * 2, d0, b1, kb, n > 16, c);
                        for (int r = 0; r < n; r++) {
                            char *yr = (char *)y + ((t + r) * O + p0 * PANEL) * (y_bf16 ? 2 : 4);
                            store16(_mm512_load_ps(c + r * 32), out_scales(f, scales, p0),
                                    bias ? bias + p0 * PANEL : NULL, nv0, yr, y_bf16);
                            if (nv1)
                                store16(_mm512_load_ps(c + r * 32 + 16), out_scales(f, scales, p1),
                                        bias ? bias + p1 * PANEL : NULL, nv1, yr + PANEL * (y_bf16 ? 2 : 4), y_bf16);
                        }
                    }
                }
            }
            amx_end();
        }
    }
    free(xs), free(dq);
    return 0;
}
#endif
#endif

static inline __attribute__((always_inline)) void tile256(const float *x, int64_t ldx, const int R, const int8_t *pw,
                                                          int64_t pairs, const int fp8, const float *bs, int64_t bpairs,
                                                          const float *scale, const float *bias, int nv, void *y,
                                                          int64_t ldy, int y_bf16) {
    __m256 sum[MAX_R2][2];
    dot256(x, ldx, R, pw, pairs, sum, fp8, bs, bpairs);
    float b[PANEL] = {0};
    if (bias) memcpy(b, bias, sizeof(float) * (size_t)nv);
    for (int r = 0; r < R; r++) {
        float v[PANEL];
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(v + 8 * h, _mm256_fmadd_ps(sum[r][h], _mm256_loadu_ps(scale + 8 * h), _mm256_loadu_ps(b + 8 * h)));
        if (y_bf16) {
            uint16_t *yr = (uint16_t *)y + r * ldy;
            if (nv == PANEL) store_bf8(yr, _mm256_loadu_ps(v)), store_bf8(yr + 8, _mm256_loadu_ps(v + 8));
            else for (int o = 0; o < nv; o++) yr[o] = to_bf(v[o]);
        } else {
            memcpy((float *)y + r * ldy, v, sizeof(float) * (size_t)nv);
        }
    }
}

#define CALL(n) \
    tile256((const float *)x, ldx, n, (const int8_t *)pw, pairs, FP8, bs, bpairs, scale, bias, nv, y, ldy, y_bf16)
#define FP8 0
static void tile_avx2(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs, int64_t bpairs,
                      const float *scale, const float *bias, int nv, void *y, int64_t ldy, int y_bf16) {
    BY_ROWS3(R, CALL)
}
#undef FP8
#define FP8 1
static void tile_avx2_fp8(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                          int64_t bpairs, const float *scale, const float *bias, int nv, void *y, int64_t ldy,
                          int y_bf16) {
    BY_ROWS3(R, CALL)
}
#undef FP8
#undef CALL

#ifndef HAVE_AMX
int shuttle_int8_amx_init(void) { return 0; }
int shuttle_int8_amx_ready(void) { return 0; }
#endif

/* Which kernels this build has: bit k for kernel k (AVX2 always). */
int shuttle_int8_kernels(void) {
    int k = 1 << KERNEL_AVX2;
#ifdef HAVE_AVX512
    k |= 1 << KERNEL_AVX512;
#endif
#ifdef HAVE_BF16DOT
    k |= 1 << KERNEL_BF16DOT;
#endif
#ifdef HAVE_AMX
    k |= 1 << KERNEL_AMX;
#endif
#ifdef HAVE_VNNI
    k |= 1 << KERNEL_VNNI;
#endif
    return k;
}

/* The table BF16DOT folds an FP8 block of scale f / 2^8 with (int8_panels.h's scaled_lut: 256 bytes, 64-byte
 * aligned, at lut), for tests. Returns 0; -2 where this build has no BF16DOT (call only where the CPU runs it). */
#ifdef HAVE_BF16DOT
TBF int shuttle_fp8_scaled_lut(float f, uint8_t *lut) {
    scaled_lut(f, lut);
    return 0;
}
#else
int shuttle_fp8_scaled_lut(float f, uint8_t *lut) {
    (void)f, (void)lut;
    return -2;
}
#endif

/* int8_linear / fp8_linear: panels and scales of format f; the arguments as shuttle_int8_linear's. */
static int linear_panels(const void *x, int x_bf16, int64_t T, int64_t I, const int8_t *panels, const float *scales,
                         const codes_fmt *f, const float *bias, int64_t O, void *y, int y_bf16, int nthreads,
                         int kernel) {
    tile_fn tile = f->fp8 ? tile_avx2_fp8 : tile_avx2;
    int dequant = 0; /* BF16DOT: linear_rows_bf, on the panels' bf16 copies */
    int max_r = MAX_R2;
    if (kernel == KERNEL_AVX512) {
#ifdef HAVE_AVX512
        tile = f->fp8 ? tile_avx512_fp8 : tile_avx512, max_r = MAX_R512;
#else
        return -2;
#endif
    } else if (kernel == KERNEL_BF16DOT) {
#ifdef HAVE_BF16DOT
        if (!x_bf16) return -2;
        dequant = 1, max_r = MAX_R512;
#else
        return -2;
#endif
    } else if (kernel == KERNEL_AMX) {
#ifdef HAVE_AMX
        if (!x_bf16 || !amx_ready || (f->fp8 && f->bpairs % 16)) return -2; /* FP8: blocks of whole k-steps */
        return linear_amx((const uint16_t *)x, T, I, panels, scales, f, bias, O, y, y_bf16, nthreads);
#else
        return -2;
#endif
    } else if (kernel != KERNEL_AVX2) {
        return -2;
    }
    const int64_t P = (O + PANEL - 1) / PANEL, Ip = I + (I & 1), pairs = Ip / 2;
    if (T <= 0 || P == 0) return 0;
    const int64_t tiles = (T + max_r - 1) / max_r;
    if (nthreads > P * tiles) nthreads = (int)(P * tiles);
    /* under passive waits a second thread must be worth its wake-up (as shuttle_gemm_bf16_panels) */
    if (passive_waits() && T * O * I < (1 << 23)) nthreads = 1;
    if (nthreads < 1) nthreads = 1;
    /* the kernels read x as float32 (bf16 for BF16DOT) rows of Ip values: in place where x is that
     * already, else a copy, zero-padded to Ip */
    const int wide = !dequant; /* float32 rows */
    const size_t xsize = wide ? 4 : 2;
    const int copy = (wide && x_bf16) || Ip != I;
    void *xs = copy ? aligned_alloc(64, ((size_t)(T * Ip) * xsize + 63) / 64 * 64) : (void *)x;
#ifdef HAVE_BF16DOT
    /* BF16DOT: per thread a chunk of two panels' bf16 copies (panels_bf), then BF_ROWS x 32 sums */
    const size_t dq_bytes = dequant ? (size_t)(pairs < bf_chunk(f) ? pairs : bf_chunk(f)) * 128 + 4 * BF_ROWS * 32 : 0;
#else
    const size_t dq_bytes = 0;
#endif
    uint16_t *dq = dequant ? aligned_alloc(64, dq_bytes * (size_t)nthreads) : NULL;
    if (!xs || (dequant && !dq)) {
        if (copy) free(xs);
        free(dq);
        return -1;
    }
    int64_t block = X_BLOCK_BYTES / (Ip * (int64_t)xsize) / max_r * max_r;
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
                if (wide) {
                    float *d = (float *)xs + t * Ip;
                    if (x_bf16) {
                        const uint16_t *s = (const uint16_t *)x + t * I;
                        for (int64_t i = 0; i < I; i++) d[i] = bf16_to_f32(s[i]);
                    } else {
                        memcpy(d, (const float *)x + t * I, sizeof(float) * (size_t)I);
                    }
                    if (Ip != I) d[I] = 0.0f;
                } else {
                    uint16_t *d = (uint16_t *)xs + t * Ip;
                    memcpy(d, (const uint16_t *)x + t * I, 2 * (size_t)I);
                    d[I] = 0;
                }
            }
        }
        /* this thread's share of the grid (grid_share_of); a thread past it has nothing to do */
        const int th = omp_get_thread_num();
        uint16_t *my_dq = dq ? (uint16_t *)((char *)dq + dq_bytes * (size_t)th) : NULL;
        grid_share g;
        if (grid_share_of(th, omp_get_num_threads(), P, unit, T, max_r, &g)) {
            const int64_t p_lo = g.p_lo, p_hi = g.p_hi, t_lo = g.t_lo, t_hi = g.t_hi;
            for (int64_t t0 = t_lo; t0 < t_hi; t0 += block) {
                const int64_t t1 = t_hi - t0 < block ? t_hi : t0 + block, ntiles = (t1 - t0 + max_r - 1) / max_r;
#ifdef HAVE_BF16DOT
                if (dequant) {
                    const int8_t *after = t1 < t_hi ? panels + p_lo * pairs * 32 : NULL;
                    float *cb = (float *)((char *)my_dq + dq_bytes - 4 * BF_ROWS * 32);
                    linear_rows_bf((const uint16_t *)xs, Ip, t0, t1, panels, scales, f, bias, O, p_lo, p_hi, y, y_bf16,
                                   after, my_dq, cb);
                    continue;
                }
#endif
                for (int64_t p = p_lo; p < p_hi; p++) {
                    const int64_t o0 = p * PANEL;
                    const int nv = O - o0 < PANEL ? (int)(O - o0) : PANEL;
                    const void *pw = panels + p * pairs * 32;
                    const float *ps = panel_scales(f, scales, p), *os = out_scales(f, scales, p);
                    for (int64_t t = t0, ti = 0, n; t < t1; t += n, ti++) {
                        n = (t1 - t + (ntiles - ti) - 1) / (ntiles - ti); /* even tiles: 17 rows -> 6, 6, 5 */
                        void *yt = (char *)y + (t * O + o0) * (y_bf16 ? 2 : 4);
                        tile((const char *)xs + t * Ip * (int64_t)xsize, Ip, (int)n, pw, pairs, f->fp8 ? ps : NULL,
                             f->bpairs, os, bias ? bias + o0 : NULL, nv, yt, O, y_bf16);
                    }
                }
            }
        }
    }
    if (copy) free(xs);
    free(dq);
    return 0;
}

/* x (T, I) float32 or bf16 (x_bf16), contiguous; int8 panels and scales as above (P = ceil(O / 16));
 * bias: O float32 values or NULL; y (T, O) float32 or bf16 (y_bf16), contiguous. kernel: AVX2,
 * AVX512, BF16DOT or AMX (bf16 x only; AMX after shuttle_int8_amx_init). Returns 0; -1 if a buffer (a
 * float32 copy of bf16 x or of x of odd I, a bf16 copy of x of odd I, the panels' bf16 copies) cannot
 * be allocated; -2 for a kernel this build lacks or that cannot take these arguments. */
int shuttle_int8_linear(const void *x, int x_bf16, int64_t T, int64_t I, const int8_t *panels, const float *scales,
                        const float *bias, int64_t O, void *y, int y_bf16, int nthreads, int kernel) {
    const codes_fmt f = {0, 0, 0};
    return linear_panels(x, x_bf16, T, I, panels, scales, &f, bias, O, y, y_bf16, nthreads, kernel);
}

/* shuttle_int8_linear on FP8 E4M3 panels (kernels/fp8_weights.py: Fp8Weight): scales (P, nb) float32,
 * panel p's scale for each block of bpairs input pairs (nb = ceil(ceil(I / 2) / bpairs)). The AVX2
 * kernel needs F16C. */
int shuttle_fp8_linear(const void *x, int x_bf16, int64_t T, int64_t I, const uint8_t *panels, const float *scales,
                       int64_t bpairs, const float *bias, int64_t O, void *y, int y_bf16, int nthreads, int kernel) {
    if (bpairs < 1) return -2;
    const int64_t pairs = (I + 1) / 2;
    /* BF16DOT folds a call's panels whole or not at all, however its threads share the rows */
    const codes_fmt f = {1, bpairs, (pairs + bpairs - 1) / bpairs, T >= FOLD_ROWS ? 1 : INT64_MAX};
    return linear_panels(x, x_bf16, T, I, (const int8_t *)panels, scales, &f, bias, O, y, y_bf16, nthreads, kernel);
}
