/* The inner loops over weight panels that int8_gemm.c (int8_linear, fp8_linear) and moe_int8.c (the
 * fused int8 and FP8 MoE blocks) share. Panels (kernels/int8.py: quantize_int8; kernels/fp8_weights.py):
 * 16 output channels x the inputs padded to an even count, stored in pairs, (ceil(O / 16), pairs, 16,
 * 2): byte 2o + k of pair j is code[o][2j + k]. Two code formats (codes_fmt):
 *  int8  one float32 scale per output channel, 16 per panel (1 past O), applied by the callers'
 *        epilogues to the dots' unscaled sums;
 *  FP8   E4M3 codes with one float32 scale per panel and block of `bpairs` input pairs (a checkpoint's
 *        weight_scale_inv of the panel's 128-row block: a panel lies inside one), `nb` per panel,
 *        applied inside the dots (each block's partial sums times its scale); the epilogues scale by 1.
 *
 * Each kernel's dot computes R rows of x (rows ldx values apart) times one panel (BF16DOT: two) into
 * 16 float32 sums per row and panel, in registers.
 *  AVX2     dot256: codes decoded to float32, FMA against float32 x, up to MAX_R2 rows.
 *  AVX512   dot512: the same with AVX-512 F/BW/VL, up to MAX_R512 rows sharing each decoded pair.
 *  BF16DOT  panels_bf: two panels (a caller's neighbours, or gate and up) at once, BF_CHUNK pairs at
 *           a time, in tiles of up to MAX_R512 bf16 rows: the first tile dequantises the chunk to
 *           bf16 side by side into the caller's buffer as it dots it, where another tile follows
 *           (FP8 two pairs at a time by byte table lookups: pairs2_fp8_bf16, AVX-512 VBMI, which
 *           BF16DOT needs) (bf_pair: 128 bytes per pair,
 *           lane o of each half = (q[o][2j], q[o][2j+1]); int8 codes and E4M3 values are exact in
 *           bf16; the conversions overlap its dot products), the other tiles read that copy; each
 *           broadcast x pair feeds both panels' AVX-512 BF16 dot products, float32 accumulation, the
 *           sums kept in the caller's buffer between chunks (FP8: per block, scaled). A lone panel
 *           (an odd last one) goes the same way by itself. While they compute, the dots prefetch
 *           into L2 the codes the thread dequantises next, so memory streams during the dots rather
 *           than only while the dequantisation waits on it. (MXFP4 panels, mxfp4_panels.h, go through
 *           the same tiles: DQ 5 and 6 below.)
 *  AMX      amx_block: blocks of 16 or 32 bf16 rows times two dequantised panels (B tiles of 16
 *           pairs x 16 outputs x 2 values), 4 accumulator tiles; dequant_tiles pads a panel with
 *           zero pairs to a multiple of 16. FP8: amx_block_fp8 stores the tiles once per input block
 *           to scale them (blocks of whole k-steps, 16 pairs).
 * So for either format every product is exact and only the float32 order of summation differs from
 * the reference (the scale applied per output for int8, per block for FP8, once per weight there).
 * Decoding E4M3 without a table: byte b as the half ((b & 0x80) << 8) | ((b & 0x7F) << 7) is b's value
 * times 2^-8, normals and subnormals alike (the exponent field moves from bias 7 to bias 15, the 3
 * mantissa bits to the top of the 10), so vcvtph2ps decodes 8 or 16 codes exactly and the 2^8 goes
 * into the block's scale (a power of two: the product rounds as code * scale would). The NaN codes
 * 0x7F / 0xFF would decode to +-480: they do not occur in weights (quantize_fp8_blocks saturates at
 * 448). The AVX2 decode is F16C's vcvtph2ps in inline assembly, so that the loops shared with int8
 * need no F16C target; kernels/fp8_weights.py runs it only where the CPU lists f16c.
 * AVX-512, BF16 (with VBMI), VNNI and AMX code carries target attributes (the library is built for AVX2 + FMA).
 * The BF16DOT and VNNI dots read x through an array of row pointers (tile_bf, tile_vn build it): indexed
 * as x[r * ldx + j], gcc gave each row of each unrolled pair its own base and spilled them (a 1536 x 1024
 * int8_linear at 256 rows took 1.11x bf16 panels' time, 1.05x with the pointers). */
#ifndef SHUTTLE_INT8_PANELS_H
#define SHUTTLE_INT8_PANELS_H
#include "bf16_avx2.h"
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#ifndef PF_LINES
#define PF_LINES 64 /* cache lines (128 pairs, 4 KiB) ahead of the panel read, prefetched into L1 */
#endif
#define KERNEL_AVX2 0
#define KERNEL_AVX512 1
#define KERNEL_BF16DOT 2
#define KERNEL_AMX 3
#define KERNEL_VNNI 4
#define MAX_R2 3
#define FP8_UNIT 256.0f /* the fp8 decodes give code * 2^-8: their blocks' scales are multiplied by 2^8 */

#ifndef FOLD_ROWS
#define FOLD_ROWS 17 /* rows from which BF16DOT folds FP8 panels with their scales (rows_bf: three tiles) */
#endif

/* A call's code format (see above): fp8 0 or 1; FP8: input pairs per scale block, blocks per panel, and
 * the rows from which BF16DOT folds (FOLD_ROWS, 1: always, INT64_MAX: never). */
typedef struct {
    int fp8;
    int64_t bpairs, nb;
    int64_t fold_rows; /* FP8 with BF16DOT: rows of a panels_bf call from which it folds the scales (rows_bf) */
} codes_fmt;

/* float32 scales of one panel (int8: its 16 outputs'; FP8: its nb blocks') */
static inline const float *panel_scales(const codes_fmt *f, const float *scales, int64_t p) {
    return scales + p * (f->fp8 ? f->nb : PANEL);
}

/* The scales an epilogue applies to one panel's sums: int8 the panel's, FP8 none (ones). */
static const float ONES[PANEL] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
static inline const float *out_scales(const codes_fmt *f, const float *scales, int64_t p) {
    return f->fp8 ? ONES : scales + p * PANEL;
}

/* A linear's thread grid (int8_gemm.c, mxfp4_gemm.c): groups of output panels (in units of `unit`
 * panels) x groups of rows in tiles of max_r, rows split only where the panel units are fewer than
 * the nt threads. Thread th's panels [p_lo, p_hi) and rows [t_lo, t_hi); 0 for a thread past the
 * grid (nothing to do). */
typedef struct {
    int64_t p_lo, p_hi, t_lo, t_hi;
} grid_share;
static inline int grid_share_of(int th, int nt, int64_t P, int64_t unit, int64_t T, int64_t max_r, grid_share *s) {
    const int64_t PU = (P + unit - 1) / unit, tiles = (T + max_r - 1) / max_r;
    const int64_t pg = PU < nt ? PU : nt, rg_all = nt / pg, rg = rg_all < tiles ? rg_all : tiles;
    if (th >= pg * rg) return 0;
    const int64_t gp = th % pg, gr = th / pg;
    const int64_t p_end = PU * (gp + 1) / pg * unit, t_end = tiles * (gr + 1) / rg * max_r;
    s->p_lo = PU * gp / pg * unit, s->p_hi = p_end < P ? p_end : P;
    s->t_lo = tiles * gr / rg * max_r, s->t_hi = t_end < T ? t_end : T;
    return 1;
}

/* 8 E4M3 codes as float32, times 2^-8 (F16C) */
static inline __attribute__((always_inline)) __m256 fp8x8(const int8_t *p) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)); /* sign-extended: bit 8 = sign */
    const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xBF80));
    __m256 f;
    __asm__("vcvtph2ps %1, %0" : "=x"(f) : "x"(h));
    return f;
}

/* 8 codes of either format as float32 (FP8: times 2^-8) */
static inline __attribute__((always_inline)) __m256 codes8(const int8_t *p, const int fp8) {
    return fp8 ? fp8x8(p) : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* AVX2: a pair j is four vectors of 8 lanes (outputs 4k..4k+3, two lanes each). */
static inline __attribute__((always_inline)) void pair256(const float *x, int64_t ldx, const int8_t *pw, int64_t j,
                                                          const int R, __m256 acc[][4], const int fp8) {
    __m256 xv[MAX_R2];
    for (int r = 0; r < R; r++)
        xv[r] = _mm256_castsi256_ps(_mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(x + r * ldx + 2 * j))));
    for (int k = 0; k < 4; k++) {
        const __m256 w = codes8(pw + j * 32 + 8 * k, fp8);
        for (int r = 0; r < R; r++) acc[r][k] = _mm256_fmadd_ps(xv[r], w, acc[r][k]);
    }
}

/* sum[r][h]: outputs 8h..8h+7 of row r, unscaled (FP8: times 2^-8) */
static inline __attribute__((always_inline)) void dot256u(const float *x, int64_t ldx, const int R, const int8_t *pw,
                                                          int64_t pairs, __m256 sum[][2], const int fp8) {
    __m256 acc[MAX_R2][4];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= pairs; j += 2) {
        _mm_prefetch((const char *)(pw + (j + 2 * PF_LINES) * 32), _MM_HINT_T0);
        pair256(x, ldx, pw, j, R, acc, fp8);
        pair256(x, ldx, pw, j + 1, R, acc, fp8);
    }
    if (j < pairs) pair256(x, ldx, pw, j, R, acc, fp8);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {
            /* hadd: [0+1, 2+3 of acc 2h; 0+1, 2+3 of acc 2h+1; 4+5, 6+7 of 2h; 4+5, 6+7 of 2h+1], i.e.
             * outputs 0, 1, 4, 5, 2, 3, 6, 7 of the eight; the 64-bit permute puts them in order */
            const __m256 s = _mm256_hadd_ps(acc[r][2 * h], acc[r][2 * h + 1]);
            sum[r][h] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8));
        }
}

/* sum[r][h]: outputs 8h..8h+7 of row r; int8 unscaled, FP8 each block's partial sums times its scale
 * bs[b] (the panel's) */
static inline __attribute__((always_inline)) void dot256(const float *x, int64_t ldx, const int R, const int8_t *pw,
                                                         int64_t pairs, __m256 sum[][2], const int fp8,
                                                         const float *bs, int64_t bpairs) {
    if (!fp8) {
        dot256u(x, ldx, R, pw, pairs, sum, 0);
        return;
    }
    for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
    for (int64_t j0 = 0, b = 0; j0 < pairs; j0 += bpairs, b++) {
        __m256 part[MAX_R2][2];
        dot256u(x + 2 * j0, ldx, R, pw + 32 * j0, pairs - j0 < bpairs ? pairs - j0 : bpairs, part, 1);
        const __m256 s = _mm256_set1_ps(bs[b] * FP8_UNIT);
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) sum[r][h] = _mm256_fmadd_ps(part[r][h], s, sum[r][h]);
    }
}

#if defined(__clang__) ? __clang_major__ >= 8 : __GNUC__ >= 8
#define HAVE_AVX512 1
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AI512 T512 static inline __attribute__((always_inline))
#define MAX_R512 8
#ifndef SPLIT_R
#define SPLIT_R 4
#endif

/* 16 codes of a panel pair, widened to float32 */
AI512 __m512 codes16(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* 32 E4M3 codes (one panel pair) as float32 times 2^-8: w0 codes 0-15, w1 codes 16-31 */
AI512 void fp8x32(const int8_t *p, __m512 *w0, __m512 *w1) {
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); /* bit 8 = sign */
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16((short)0xBF80));
    *w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

/* One panel pair's 32 codes of either format as float32 (FP8: times 2^-8) */
AI512 void pair_codes(const int8_t *p, const int fp8, __m512 *w0, __m512 *w1) {
    if (fp8) fp8x32(p, w0, w1);
    else *w0 = codes16(p), *w1 = codes16(p + 16);
}

/* x[2j], x[2j + 1] in every pair of lanes */
AI512 __m512 xpair16(const float *x) { return _mm512_castsi512_ps(_mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)x))); }

/* One pair j of the panel for R rows: acc[r][0] (outputs 0-7) and acc[r][1] (8-15) += q x. */
AI512 void pair512(const float *x, int64_t ldx, const int8_t *pw, int64_t j, const int R, __m512 acc[][2],
                   const int fp8) {
    __m512 w0, w1;
    pair_codes(pw + j * 32, fp8, &w0, &w1);
    for (int r = 0; r < R; r++) {
        const __m512 xv = xpair16(x + r * ldx + 2 * j);
        acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
}

/* bf16 bits (nearest even, NaN kept quiet) of 16 floats, packed */
AI512 __m256i to_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* y[0..nv) = sum * scale (+ bias), float32 or rounded to bf16 */
AI512 void store16(__m512 sum, const float *scale, const float *bias, int nv, void *y, int y_bf16) {
    const __mmask16 m = nv >= 16 ? 0xFFFF : (__mmask16)((1u << nv) - 1);
    const __m512 v = bias ? _mm512_fmadd_ps(sum, _mm512_loadu_ps(scale), _mm512_maskz_loadu_ps(m, bias))
                          : _mm512_mul_ps(sum, _mm512_loadu_ps(scale));
    if (y_bf16) _mm256_mask_storeu_epi16(y, m, to_bf16x16(v));
    else _mm512_mask_storeu_ps(y, m, v);
}

/* sum[r]: the 16 outputs of row r, unscaled (FP8: times 2^-8). acc[s]: the even pairs (s = 0) and the
 * odd ones (s = 1, up to SPLIT_R rows: more chains of FMAs in flight where few rows give few). */
AI512 void dot512u(const float *x, int64_t ldx, const int R, const int8_t *pw, int64_t pairs, __m512 sum[],
                   const int fp8) {
    const int S = R <= SPLIT_R ? 2 : 1;
    __m512 acc[2][MAX_R512][2];
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++) acc[s][r][0] = acc[s][r][1] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= pairs; j += 2) { /* one 64-byte line of the panel per iteration */
        _mm_prefetch((const char *)(pw + (j + 2 * PF_LINES) * 32), _MM_HINT_T0);
        pair512(x, ldx, pw, j, R, acc[0], fp8);
        pair512(x, ldx, pw, j + 1, R, acc[S - 1], fp8);
    }
    if (j < pairs) pair512(x, ldx, pw, j, R, acc[0], fp8);
    if (S == 2)
        for (int r = 0; r < R; r++)
            acc[0][r][0] = _mm512_add_ps(acc[0][r][0], acc[1][r][0]), acc[0][r][1] = _mm512_add_ps(acc[0][r][1], acc[1][r][1]);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int r = 0; r < R; r++)
        sum[r] = _mm512_add_ps(_mm512_permutex2var_ps(acc[0][r][0], even, acc[0][r][1]),
                               _mm512_permutex2var_ps(acc[0][r][0], odd, acc[0][r][1]));
}

/* sum[r]: the 16 outputs of row r; int8 unscaled, FP8 each block's partial sums times its scale bs[b] */
AI512 void dot512(const float *x, int64_t ldx, const int R, const int8_t *pw, int64_t pairs, __m512 sum[],
                  const int fp8, const float *bs, int64_t bpairs) {
    if (!fp8) {
        dot512u(x, ldx, R, pw, pairs, sum, 0);
        return;
    }
    for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_ps();
    for (int64_t j0 = 0, b = 0; j0 < pairs; j0 += bpairs, b++) {
        __m512 part[MAX_R512];
        dot512u(x + 2 * j0, ldx, R, pw + 32 * j0, pairs - j0 < bpairs ? pairs - j0 : bpairs, part, 1);
        const __m512 s = _mm512_set1_ps(bs[b] * FP8_UNIT);
        for (int r = 0; r < R; r++) sum[r] = _mm512_fmadd_ps(part[r], s, sum[r]);
    }
}

#if defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10
#define HAVE_BF16DOT 1
#define TBF0 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TBF __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))
#define AIBF0 TBF0 static inline __attribute__((always_inline))
#define AIBF TBF static inline __attribute__((always_inline))
/* Pairs of two panels dequantised at a time: 128 KiB of bf16, in L2, however long the panels. Chunks
 * that stay in L1 measured slower than whole panels (D = 1024, 1 thread: 128 pairs 3-7% in the int8
 * MoE at 16-256 tokens and 8% in int8_linear at 256 rows, 256 pairs 2-4%): each tile's loop is set up
 * again per chunk and its sums stored and reloaded, while L2 feeds the dots fast enough. */
#define BF_CHUNK 1024
#define BF_ROWS 512 /* the most rows of one call of panels_bf (its buffer of sums: 64 KiB) */
#define BF_SPLIT 4  /* rows up to which dotbf_u keeps the even and odd pairs' sums apart */
#define FOLD_MAX_BLOCKS 64 /* FP8 blocks of a chunk whose tables rows_bf keeps on the stack (32 KiB) */

/* One pair of a panel (32 codes of either format) as 16 bf16 pairs, lane o = (q[o][2j], q[o][2j+1]) (FP8
 * times 2^-8): the codes' float32 values are exact in bf16, so their top halves are the bf16 values,
 * gathered by one word permute (up to 3% faster than vcvtne2ps2bf16 in the int8 MoE at 16-64 tokens). */
AIBF0 __m512i pair_bf16(const int8_t *p, const int fp8) {
    __m512 w0, w1;
    pair_codes(p, fp8, &w0, &w1);
    const __m512i tops = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                          23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1); /* word 2i + 1 of (w0, w1) */
    return _mm512_permutex2var_epi16(_mm512_castps_si512(w0), tops, _mm512_castps_si512(w1));
}

/* A panel's codes (`pairs` pairs) as bf16 pairs in d, 64-byte aligned: int8 codes; FP8 codes times 2^-8
 * (E4M3 values, 2^-9..448, times 2^-8 are exact in bf16); the scales stay out, for the dots. */
TBF0 static inline void dequant_bf16(const int8_t *pw, int64_t pairs, uint16_t *d, const int fp8) {
    for (int64_t j = 0; j < pairs; j++) {
        if (!(j & 1)) _mm_prefetch((const char *)(pw + (j + 2 * PF_LINES) * 32), _MM_HINT_T0);
        _mm512_store_si512(d + 32 * j, pair_bf16(pw + 32 * j, fp8));
    }
}

/* The bf16 bits of pair_bf16's value (times 2^-8) of each of the 128 E4M3 magnitudes, low bytes then high
 * bytes. E4M3 is sign-magnitude as bf16 is, so a byte lookup of each half on the magnitude and the
 * code's sign bit or'ed into the high byte give pair_bf16's bits. */
static const uint8_t FP8_LUT[2][128] __attribute__((aligned(64))) = {
    {
        0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
        0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
        0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
        0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
        0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
        0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
        0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0,
        0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 0xF0},
    {
        0x00, 0x37, 0x37, 0x37, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0x38,
        0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39,
        0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A, 0x3A,
        0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B, 0x3B,
        0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C, 0x3C,
        0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D, 0x3D,
        0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E, 0x3E,
        0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F, 0x3F}};
/* byte 2i of word i (< 32) from the low bytes (0-63), 2i + 1 from the high bytes (64-127): pair j, j + 1 */
static const uint8_t BF_WORDS[2][64] __attribute__((aligned(64))) = {
    {
        0, 64, 1, 65, 2, 66, 3, 67, 4, 68, 5, 69, 6, 70, 7, 71,
        8, 72, 9, 73, 10, 74, 11, 75, 12, 76, 13, 77, 14, 78, 15, 79,
        16, 80, 17, 81, 18, 82, 19, 83, 20, 84, 21, 85, 22, 86, 23, 87,
        24, 88, 25, 89, 26, 90, 27, 91, 28, 92, 29, 93, 30, 94, 31, 95},
    {
        32, 96, 33, 97, 34, 98, 35, 99, 36, 100, 37, 101, 38, 102, 39, 103,
        40, 104, 41, 105, 42, 106, 43, 107, 44, 108, 45, 109, 46, 110, 47, 111,
        48, 112, 49, 113, 50, 114, 51, 115, 52, 116, 53, 117, 54, 118, 55, 119,
        56, 120, 57, 121, 58, 122, 59, 123, 60, 124, 61, 125, 62, 126, 63, 127}};

/* Two pairs of an FP8 panel (64 codes c; pairs2_fp8_bf16 loads them from p) as pair_bf16 gives each,
 * *a pair j and *b pair j + 1, bit for bit: two vpermi2b lookups of the magnitude in a table of bf16 bits
 * (FP8_LUT's layout: 128 low bytes, then 128 high bytes; index bit 7 is ignored), the sign xor'ed in, two
 * vpermt2b putting the halves together: 5 instructions where pair_bf16 takes 14. (For int8 codes the same
 * lookups on |q| measured 3-6% slower than pair_bf16's widening at 16-64 tokens in the MoE block.) lut:
 * FP8_LUT (code * 2^-8) or a block's scaled_lut (code * scale). */
AIBF void fp8_codes_bf16(const __m512i c, const uint8_t *lut, __m512i *a, __m512i *b) {
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(lut), c, _mm512_load_si512(lut + 64));
    const __m512i hi = _mm512_ternarylogic_epi32(
        _mm512_permutex2var_epi8(_mm512_load_si512(lut + 128), c, _mm512_load_si512(lut + 192)), c,
        _mm512_set1_epi8((char)0x80), 0x78); /* hi ^ (c & 0x80) */
    *a = _mm512_permutex2var_epi8(lo, _mm512_load_si512(BF_WORDS[0]), hi);
    *b = _mm512_permutex2var_epi8(lo, _mm512_load_si512(BF_WORDS[1]), hi);
}
AIBF void pairs2_fp8_bf16(const int8_t *p, const uint8_t *lut, __m512i *a, __m512i *b) {
    fp8_codes_bf16(_mm512_loadu_si512(p), lut, a, b);
}

/* One pair (32 codes) as pairs2_fp8_bf16 gives it, reading no byte past the pair. */
AIBF __m512i pair_fp8_bf16(const int8_t *p, const uint8_t *lut) {
    __m512i a, b;
    fp8_codes_bf16(_mm512_maskz_loadu_epi8(0xFFFFFFFFull, p), lut, &a, &b);
    return a;
}

/* Each E4M3 magnitude i (8 e + m) as (1 + SL_MANT[i] / 8) 2^k, SL_EXP[i] = 128 k (k in bf16's exponent
 * field): e >= 1 mantissa m, k = e - 7; the subnormals m 2^-9 as 1, 1.25, 1.5 or 1.75 times a power of two;
 * i = 0 (zero) is set apart; 127 (a NaN code, never in weights) is SL_MANT 7, k = 8 (480), as FP8_LUT has it. */
static const int16_t SL_MANT[128] __attribute__((aligned(64))) = {
    0, 0, 0, 4, 0, 2, 4, 6, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
    0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7};
static const int16_t SL_EXP[128] __attribute__((aligned(64))) = {
    0, -1152, -1024, -1024, -896, -896, -896, -896, -768, -768, -768, -768, -768, -768, -768, -768,
    -640, -640, -640, -640, -640, -640, -640, -640, -512, -512, -512, -512, -512, -512, -512, -512,
    -384, -384, -384, -384, -384, -384, -384, -384, -256, -256, -256, -256, -256, -256, -256, -256,
    -128, -128, -128, -128, -128, -128, -128, -128, 0, 0, 0, 0, 0, 0, 0, 0,
    128, 128, 128, 128, 128, 128, 128, 128, 256, 256, 256, 256, 256, 256, 256, 256,
    384, 384, 384, 384, 384, 384, 384, 384, 512, 512, 512, 512, 512, 512, 512, 512,
    640, 640, 640, 640, 640, 640, 640, 640, 768, 768, 768, 768, 768, 768, 768, 768,
    896, 896, 896, 896, 896, 896, 896, 896, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024};

/* FP8_LUT scaled for one block: lut's 128 magnitudes the bf16 bits of code * scale (f = scale * 2^8 times
 * FP8_LUT's code * 2^-8: the same real number as code * scale, so the same float32, then rounded to
 * nearest even once; a product below float32's normals, at scales under ~2^-117, flushes to zero), as a
 * checkpoint dequantised to bf16 (kernels/quant.py) has its weights. 64-byte aligned, 256 bytes.
 * Where every product is a normal float32 and bf16 (|scale| in [2^-117, 2^117]) the 8 mantissas' products
 * (1 + m / 8) scale are rounded once and each magnitude's bits are its mantissa's plus its power of two in
 * the exponent field (scaling by 2^k moves neither rounding): the same bits, 4 word permutes instead of 128
 * products (the tables are built per block and panel of every folded call: 2.7% of the fused FP8 MoE at 256
 * tokens, 8 x 1024 x 2048 on the Zen 5 EPYC). */
AIBF void scaled_lut(float f, uint8_t *lut) {
    const float a = f < 0.0f ? -f : f;
    if (a >= 0x1p-109f && a <= 0x1p125f) {
        const __m256 prod = _mm256_mul_ps(_mm256_setr_ps(1.0f, 1.125f, 1.25f, 1.375f, 1.5f, 1.625f, 1.75f, 1.875f),
                                          _mm256_set1_ps(f * 0x1p-8f));
        const __m512i base = _mm512_castsi128_si512((__m128i)_mm256_cvtneps_pbh(prod));
        const __m512i zero = _mm512_set1_epi16(f < 0.0f ? (short)0x8000 : 0); /* 0 * f: -0 for a negative f */
        for (int g = 0; g < 4; g++) {
            __m512i w = _mm512_add_epi16(_mm512_permutexvar_epi16(_mm512_load_si512(SL_MANT + 32 * g), base),
                                         _mm512_load_si512(SL_EXP + 32 * g));
            if (g == 0) w = _mm512_mask_mov_epi16(w, 1, zero);
            _mm256_store_si256((__m256i *)(lut + 32 * g), _mm512_cvtepi16_epi8(w));
            _mm256_store_si256((__m256i *)(lut + 128 + 32 * g), _mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 8)));
        }
        return;
    }
    const __m512 fv = _mm512_set1_ps(f);
    for (int i = 0; i < 128; i += 16) {
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(FP8_LUT[0] + i)));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)(FP8_LUT[1] + i)));
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_or_si512(_mm512_slli_epi32(hi, 8), lo), 16));
        const __m256i w = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, fv));
        _mm_store_si128((__m128i *)(lut + i), _mm256_cvtepi16_epi8(_mm256_and_si256(w, _mm256_set1_epi16(0xFF))));
        _mm_store_si128((__m128i *)(lut + 128 + i), _mm256_cvtepi16_epi8(_mm256_srli_epi16(w, 8)));
    }
}


/* One pair of an MXFP4 panel (mxfp4_gemm.c's layout: 16 bytes, byte o = row o's codes of inputs 2j (low
 * nibble) and 2j + 1) as pair_bf16 lays it out, with its block's scales folded in: each nibble's FP4
 * value as bf16 from a 16-word table (one word permute), then `add` (the block's mx_block_add: each row's
 * e - 127 in the exponent field of both words) added to the nonzero words. Exact for blocks whose
 * scales mx_block_add accepts (every product normal or zero). */
AIBF0 __m512i mx_pair_bf16(const uint8_t *p, const __m512i add) {
    const __m512i words = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, (short)0xC0C0,
                                           (short)0xC080, (short)0xC040, (short)0xC000, (short)0xBFC0, (short)0xBF80,
                                           (short)0xBF00, (short)0x8000, 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0,
                                           0x3F80, 0x3F00, 0); /* FP4_VALUES (kernels/quant.py) in bf16 */
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    /* word 0 of a lane: the low nibble (input 2j), word 1: the high one (input 2j + 1) */
    const __m512i idx = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    const __m512i w = _mm512_permutexvar_epi16(idx, words);
    return _mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7FFF)), w, add);
}

/* The 16 E8M0 scale bytes of an MXFP4 block as mx_pair_bf16's `add` (64 bytes at a); 0 if some scale
 * would leave bf16's normal range (e < 2 or e > 252: the caller decodes such blocks in float32). */
AIBF0 int mx_block_add(const uint8_t *e, uint8_t *a) {
    const __m128i e8 = _mm_loadu_si128((const __m128i *)e);
    if (_mm_movemask_epi8(_mm_and_si128(_mm_cmpeq_epi8(_mm_max_epu8(e8, _mm_set1_epi8(2)), e8),
                                        _mm_cmpeq_epi8(_mm_min_epu8(e8, _mm_set1_epi8((char)252)), e8))) != 0xFFFF)
        return 0;
    const __m512i shift = _mm512_and_si512(
        _mm512_slli_epi32(_mm512_sub_epi32(_mm512_cvtepu8_epi32(e8), _mm512_set1_epi32(127)), 7), _mm512_set1_epi32(0xFFFF));
    _mm512_store_si512(a, _mm512_or_si512(shift, _mm512_slli_epi32(shift, 16)));
    return 1;
}

/* Pair j of NP (1 or 2) panels side by side in d (pair j of panel k at d + 32 (NP j + k): 32 outputs a
 * pair, moe_avx512bf16.c's panel layout, so the dots read one stream) for R rows: acc[r][k] += x pair
 * of row r . panel k; one broadcast of x feeds both panels' dot products. DQ (a constant) 1: the pair
 * is dequantised here from the codes q0 (q1) of format fp8 and stored into d on the way (the first
 * tile of rows: the conversions overlap its dot products); 2: dequantised, not stored (the only tile:
 * stores nobody reads cost streaming codes 10-15% at one row); 3 and 4: as 1 and 2, FP8 codes decoded
 * with their block's scaled_lut (l0 panel 0's, l1 panel 1's); 5 and 6: as 1 and 2, MXFP4 codes (q0, q1:
 * 16 bytes a pair) decoded by mx_pair_bf16 with their blocks' adds (l0, l1: 64 bytes per block of 16
 * pairs, mx_block_add); 0: read from d. */
AIBF void bf_pair(const uint32_t *const *xr, const int R, const int NP, uint16_t *d, int64_t j, __m512 acc[][2],
                  const int8_t *q0, const int8_t *q1, const int fp8, const int DQ, const uint8_t *l0,
                  const uint8_t *l1) {
    __m512bh w0, w1;
    if (DQ >= 5) {
        const __m512i a = mx_pair_bf16((const uint8_t *)q0 + 16 * j, _mm512_load_si512(l0 + 64 * (j >> 4)));
        const __m512i b = NP == 1 ? a : mx_pair_bf16((const uint8_t *)q1 + 16 * j, _mm512_load_si512(l1 + 64 * (j >> 4)));
        if (DQ == 5) _mm512_store_si512(d + 32 * NP * j, a);
        if (DQ == 5 && NP == 2) _mm512_store_si512(d + 64 * j + 32, b);
        w0 = (__m512bh)a, w1 = (__m512bh)b;
    } else if (DQ) {
        const __m512i a = DQ >= 3 ? pair_fp8_bf16(q0 + 32 * j, l0) : pair_bf16(q0 + 32 * j, fp8);
        const __m512i b = NP == 1 ? a : DQ >= 3 ? pair_fp8_bf16(q1 + 32 * j, l1) : pair_bf16(q1 + 32 * j, fp8);
        if (DQ & 1) _mm512_store_si512(d + 32 * NP * j, a);
        if ((DQ & 1) && NP == 2) _mm512_store_si512(d + 64 * j + 32, b);
        w0 = (__m512bh)a, w1 = (__m512bh)b;
    } else {
        w0 = (__m512bh)_mm512_load_si512(d + 32 * NP * j);
        w1 = NP == 2 ? (__m512bh)_mm512_load_si512(d + 64 * j + 32) : w0;
    }
    for (int r = 0; r < R; r++) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[r][j]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        if (NP == 2) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
}

/* Pairs j and j + 1 (bf_pair twice: pair j into acc0, j + 1 into acc1, which may be the same sums: each
 * sum still adds pair j first), the dequantising tiles decoding both at once (FP8: pairs2_fp8_bf16). */
AIBF void bf_pair2(const uint32_t *const *xr, const int R, const int NP, uint16_t *d, int64_t j,
                   __m512 acc0[][2], __m512 acc1[][2], const int8_t *q0, const int8_t *q1, const int fp8,
                   const int DQ, const uint8_t *l0, const uint8_t *l1) {
    if (!DQ || DQ >= 5) { /* (MXFP4 decodes pair by pair) */
        bf_pair(xr, R, NP, d, j, acc0, q0, q1, fp8, DQ, l0, l1);
        bf_pair(xr, R, NP, d, j + 1, acc1, q0, q1, fp8, DQ, l0, l1);
        return;
    }
    __m512i a0, b0, a1, b1;
    if (fp8) {
        pairs2_fp8_bf16(q0 + 32 * j, DQ >= 3 ? l0 : FP8_LUT[0], &a0, &b0);
        if (NP == 2) pairs2_fp8_bf16(q1 + 32 * j, DQ >= 3 ? l1 : FP8_LUT[0], &a1, &b1);
    } else {
        a0 = pair_bf16(q0 + 32 * j, 0), b0 = pair_bf16(q0 + 32 * j + 32, 0);
        if (NP == 2) a1 = pair_bf16(q1 + 32 * j, 0), b1 = pair_bf16(q1 + 32 * j + 32, 0);
    }
    if (NP == 1) a1 = a0, b1 = b0;
    if (DQ & 1) {
        _mm512_store_si512(d + 32 * NP * j, a0);
        _mm512_store_si512(d + 32 * NP * (j + 1), b0);
        if (NP == 2) _mm512_store_si512(d + 64 * j + 32, a1), _mm512_store_si512(d + 64 * (j + 1) + 32, b1);
    }
    for (int r = 0; r < R; r++) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)xr[r][j]);
        acc0[r][0] = _mm512_dpbf16_ps(acc0[r][0], x0, (__m512bh)a0);
        if (NP == 2) acc0[r][1] = _mm512_dpbf16_ps(acc0[r][1], x0, (__m512bh)a1);
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32((int)xr[r][j + 1]);
        acc1[r][0] = _mm512_dpbf16_ps(acc1[r][0], x1, (__m512bh)b0);
        if (NP == 2) acc1[r][1] = _mm512_dpbf16_ps(acc1[r][1], x1, (__m512bh)b1);
    }
}

/* The codes a dequantising tile reads: q0 and q1, their format (and DQ 3's scales); NO_CODES: d holds the
 * panels already. */
#define MX_CODES 2 /* bf_codes.fp8 of MXFP4 codes (mxfp4_panels.h's panels_mx) */
typedef struct {
    const int8_t *q0, *q1;
    int fp8; /* 0 int8, 1 FP8, MX_CODES MXFP4 */
    const uint8_t *l0, *l1; /* DQ 3, 4: the block's scaled_lut of panel 0 and 1; 5, 6: the blocks' adds */
    int64_t fold_rows;      /* (rows_bf) codes_fmt's */
} bf_codes;
static const bf_codes NO_CODES = {NULL, NULL, 0};

/* Pairs [j0, j1) (j1 - j0 even) for R rows, the even pairs into acc[0] and the odd ones into acc[S - 1],
 * prefetching `per` (0, 1 or 2: a constant) lines from *pf into L2 each two pairs; DQ: see bf_pair
 * (the codes prefetched into L1 PF_LINES lines ahead). */
AIBF void bf_span(const uint32_t *const *xr, const int R, const int NP, uint16_t *d, int64_t j0, int64_t j1,
                  const int S, __m512 acc[][MAX_R512][2], const char **pf, const int per, const bf_codes *q,
                  const int DQ) {
    for (int64_t j = j0; j < j1; j += 2) {
        if (per) _mm_prefetch(*pf, _MM_HINT_T1);
        if (per == 2) _mm_prefetch(*pf + 64, _MM_HINT_T1);
        *pf += 64 * per;
        if (DQ) {
            const int64_t at = (j + 2 * PF_LINES) * (DQ >= 5 ? 16 : 32); /* (MXFP4: 16 bytes a pair) */
            if (DQ < 5 || !(j & 3)) {
                _mm_prefetch((const char *)(q->q0 + at), _MM_HINT_T0);
                if (NP == 2) _mm_prefetch((const char *)(q->q1 + at), _MM_HINT_T0);
            }
        }
        bf_pair2(xr, R, NP, d, j, acc[0], acc[S - 1], q->q0, q->q1, q->fp8, DQ, q->l0, q->l1);
    }
}

/* s[r][k] += x pairs of row r (one 32-bit broadcast each, from xr[r]) . panel k of d (lane =
 * output), unscaled. On the way it asks for pf_lines cache lines from pf into L2 (two every two pairs,
 * then one, then none: three loops with no check in them): codes the thread dequantises next, so that
 * memory streams while the dots compute (as moe_avx512bf16.c's panel_dot does) rather than only while
 * the dequantisation waits on it. acc[s]: the even pairs (s = 0) and, up to BF_SPLIT rows, the odd
 * ones (s = 1): more chains of dot products in flight where few rows give few, in 16 registers at
 * most. The order of a panel's sums depends on R only, not on whether another panel is dotted
 * alongside (threads may pair the panels differently). DQ: see bf_pair. */
AIBF void dotbf_u(const uint32_t *const *xr, const int R, const int NP, uint16_t *d, int64_t pairs, __m512 s[][2],
                  const char *pf, int64_t pf_lines, const bf_codes *q, const int DQ) {
    const int S = R <= BF_SPLIT ? 2 : 1;
    __m512 acc[2][MAX_R512][2];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NP; k++) acc[0][r][k] = s[r][k], acc[1][r][k] = _mm512_setzero_ps();
    const int64_t steps = pairs / 2, lines = pf_lines < 2 * steps ? pf_lines : 2 * steps;
    const int64_t two = lines > steps ? lines - steps : 0, one = lines - 2 * two; /* steps of 2 and 1 lines */
    bf_span(xr, R, NP, d, 0, 2 * two, S, acc, &pf, 2, q, DQ);
    bf_span(xr, R, NP, d, 2 * two, 2 * (two + one), S, acc, &pf, 1, q, DQ);
    bf_span(xr, R, NP, d, 2 * (two + one), 2 * steps, S, acc, &pf, 0, q, DQ);
    if (pairs & 1) bf_pair(xr, R, NP, d, pairs - 1, acc[0], q->q0, q->q1, q->fp8, DQ, q->l0, q->l1);
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NP; k++) s[r][k] = S == 2 ? _mm512_add_ps(acc[0][r][k], acc[1][r][k]) : acc[0][r][k];
}

/* c rows (ldc floats apart; [panel 0's 16 sums, panel 1's 16]) of R rows: set (first) or added to by
 * dotbf_u over NP panels of either format: int8 unscaled (bs0 NULL); FP8 each block of bpairs pairs'
 * sums times its scale (bs0[b] panel 0's, bs1[b] panel 1's). FP8's running sums stay in c (in L1)
 * between blocks: in registers beside each block's own sums they would not fit. Folded FP8 (rows_bf):
 * DQ 3 decodes block b with its tables q->l0 + 512 b, q->l1 + 512 b, and every tile sums unscaled. With
 * more than BF_SPLIT rows (as folding has) the blocks' calls add in the order of one call over them, so
 * the DQ 3 tile's rows get the same bits as another tile's. */
AIBF void tile_bf(const uint32_t *x, int64_t ldx, const int R, const int NP, uint16_t *d, int64_t pairs,
                  const float *bs0, const float *bs1, int64_t bpairs, int first, const char *pf, int64_t pf_lines,
                  float *c, int64_t ldc, const bf_codes *q, const int DQ) {
    const uint32_t *xr[MAX_R512]; /* row pointers: one register each in the dots' loops */
    for (int r = 0; r < R; r++) xr[r] = x + r * ldx;
    __m512 s[MAX_R512][2];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NP; k++) s[r][k] = first || bs0 ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * k);
    if (DQ == 3 || DQ == 4) { /* FP8 folded: each block's pairs decoded with its scaled_lut; no sums to scale */
        for (int64_t j0 = 0, b = 0; j0 < pairs; j0 += bpairs, b++) {
            const int64_t n = pairs - j0 < bpairs ? pairs - j0 : bpairs;
            const int64_t l0 = pf_lines * j0 / pairs, l1 = pf_lines * (j0 + n) / pairs;
            const bf_codes qb = {q->q0 + 32 * j0, NP == 2 ? q->q1 + 32 * j0 : NULL, 1, q->l0 + 512 * b, q->l1 + 512 * b};
            const uint32_t *xb[MAX_R512];
            for (int r = 0; r < R; r++) xb[r] = xr[r] + j0;
            dotbf_u(xb, R, NP, d + 32 * NP * j0, n, s, pf + 64 * l0, l1 - l0, &qb, DQ);
        }
    } else if (!bs0) {
        dotbf_u(xr, R, NP, d, pairs, s, pf, pf_lines, q, DQ);
    }
    if (DQ >= 3 || !bs0) {
        for (int r = 0; r < R; r++)
            for (int k = 0; k < NP; k++) _mm512_storeu_ps(c + r * ldc + 16 * k, s[r][k]);
        return;
    }
    if (first)
        for (int r = 0; r < R; r++)
            for (int k = 0; k < NP; k++) _mm512_storeu_ps(c + r * ldc + 16 * k, s[r][k]);
    for (int64_t j0 = 0, b = 0; j0 < pairs; j0 += bpairs, b++) {
        const int64_t n = pairs - j0 < bpairs ? pairs - j0 : bpairs;
        const int64_t l0 = pf_lines * j0 / pairs, l1 = pf_lines * (j0 + n) / pairs; /* this block's lines */
        const bf_codes qb = {DQ ? q->q0 + 32 * j0 : NULL, DQ && NP == 2 ? q->q1 + 32 * j0 : NULL, q->fp8};
        const uint32_t *xb[MAX_R512];
        for (int r = 0; r < R; r++) xb[r] = xr[r] + j0, s[r][0] = s[r][1] = _mm512_setzero_ps();
        dotbf_u(xb, R, NP, d + 32 * NP * j0, n, s, pf + 64 * l0, l1 - l0, &qb, DQ);
        const __m512 c0 = _mm512_set1_ps(bs0[b] * FP8_UNIT), c1 = _mm512_set1_ps(NP == 2 ? bs1[b] * FP8_UNIT : 0.0f);
        for (int r = 0; r < R; r++) {
            float *cr = c + r * ldc;
            _mm512_storeu_ps(cr, _mm512_fmadd_ps(s[r][0], c0, _mm512_loadu_ps(cr)));
            if (NP == 2) _mm512_storeu_ps(cr + 16, _mm512_fmadd_ps(s[r][1], c1, _mm512_loadu_ps(cr + 16)));
        }
    }
}

/* tile_bf for 1..MAX_R512 rows (R a constant in each case), NP panels, dequantising (DQ) or not */
#define TILE_BF_ARGS                                                                                        \
    const uint32_t *x, int64_t ldx, int R, uint16_t *d, int64_t pairs, const float *bs0, const float *bs1, \
        int64_t bpairs, int first, const char *pf, int64_t pf_lines, float *c, int64_t ldc, const bf_codes *q
#define TILE_BF(np, dq) \
    TBF static void tile_bf##np##_##dq(TILE_BF_ARGS) { BY_ROWS(R, TILE_BF_##np##_##dq) }
#define TILE_BF_CALL(n, np, dq) tile_bf(x, ldx, n, np, d, pairs, bs0, bs1, bpairs, first, pf, pf_lines, c, ldc, q, dq)
#define TILE_BF_1_0(n) TILE_BF_CALL(n, 1, 0)
#define TILE_BF_2_0(n) TILE_BF_CALL(n, 2, 0)
#define TILE_BF_1_1(n) TILE_BF_CALL(n, 1, 1)
#define TILE_BF_2_1(n) TILE_BF_CALL(n, 2, 1)
#define TILE_BF_1_2(n) TILE_BF_CALL(n, 1, 2)
#define TILE_BF_2_2(n) TILE_BF_CALL(n, 2, 2)
#define TILE_BF_1_3(n) TILE_BF_CALL(n, 1, 3)
#define TILE_BF_2_3(n) TILE_BF_CALL(n, 2, 3)
#define TILE_BF_1_4(n) TILE_BF_CALL(n, 1, 4)
#define TILE_BF_2_4(n) TILE_BF_CALL(n, 2, 4)
#define TILE_BF_1_5(n) TILE_BF_CALL(n, 1, 5)
#define TILE_BF_2_5(n) TILE_BF_CALL(n, 2, 5)
#define TILE_BF_1_6(n) TILE_BF_CALL(n, 1, 6)
#define TILE_BF_2_6(n) TILE_BF_CALL(n, 2, 6)
TILE_BF(1, 0)
TILE_BF(2, 0)
TILE_BF(1, 1)
TILE_BF(2, 1)
TILE_BF(1, 2)
TILE_BF(2, 2)
TILE_BF(1, 3)
TILE_BF(2, 3)
TILE_BF(1, 4)
TILE_BF(2, 4)
TILE_BF(1, 5)
TILE_BF(2, 5)
TILE_BF(1, 6)
TILE_BF(2, 6)
#undef TILE_BF_1_0
#undef TILE_BF_2_0
#undef TILE_BF_1_1
#undef TILE_BF_2_1
#undef TILE_BF_1_2
#undef TILE_BF_2_2
#undef TILE_BF_1_3
#undef TILE_BF_2_3
#undef TILE_BF_1_4
#undef TILE_BF_2_4
#undef TILE_BF_1_5
#undef TILE_BF_2_5
#undef TILE_BF_1_6
#undef TILE_BF_2_6
#undef TILE_BF_CALL
#undef TILE_BF
typedef void tile_bf_fn(TILE_BF_ARGS);
#undef TILE_BF_ARGS

/* tile_bf over `rows` rows in tiles of up to MAX_R512 rows, as even as they go (17 rows: 6, 6, 5),
 * each prefetching its share of the pf_lines lines; with codes (q->q0 set) the first tile dequantises
 * them into d and the others read d. FP8 codes of a call of at least q->fold_rows rows are folded with
 * their blocks' scales as the first tile decodes them (DQ 3 or 4: a table per block and panel,
 * scaled_lut), so that no tile scales its sums per block: each weight rounds to bf16 once, as in the
 * checkpoint dequantised to bf16, instead of every product being exact. From three tiles up that is
 * faster (scaling the sums costs every tile each block; the tables cost once per block): fp8_linear
 * 1536 x 1024 at 256 rows 1.09 -> 1.05x bf16 panels' time, the fused FP8 MoE (8 x 1024 x 2048, top-2)
 * at 256 tokens 1.07 -> 1.03-1.06x, 48-128 tokens within 1%. */
TBF static void rows_bf(const uint32_t *x, int64_t ldx, int64_t rows, int NP, uint16_t *d, int64_t pairs,
                        const float *bs0, const float *bs1, int64_t bpairs, int first, const char *pf,
                        int64_t pf_lines, float *c, int64_t ldc, const bf_codes *q) {
    const int64_t tiles = (rows + MAX_R512 - 1) / MAX_R512, blocks = bs0 ? (pairs + bpairs - 1) / bpairs : 0;
    int fold = q->q0 && bs0 && rows >= q->fold_rows;
    uint8_t stack[fold && blocks <= FOLD_MAX_BLOCKS ? blocks : 1][2][256] __attribute__((aligned(64)));
    uint8_t(*luts)[2][256] = stack, (*heap)[2][256] = NULL; /* each block's scaled_lut, per panel */
    if (fold && blocks > FOLD_MAX_BLOCKS) /* (blocks of a few inputs; unfolded only without the memory) */
        fold = (luts = heap = aligned_alloc(64, (size_t)blocks * 512)) != NULL;
    bf_codes qf = *q;
    if (fold) {
        for (int64_t b = 0; b < blocks; b++) {
            scaled_lut(bs0[b] * FP8_UNIT, luts[b][0]);
            if (NP == 2) scaled_lut(bs1[b] * FP8_UNIT, luts[b][1]);
        }
        qf.l0 = luts[0][0], qf.l1 = luts[0][1], bs0 = bs1 = NULL;
    }
    for (int64_t r = 0, ti = 0, n; r < rows; r += n, ti++) {
        n = (rows - r + (tiles - ti) - 1) / (tiles - ti);
        const int64_t l0 = pf_lines * ti / tiles, l1 = pf_lines * (ti + 1) / tiles;
        /* (2, 4: the only tile, no copy kept) */
        const int dq = ti == 0 && q->q0 ? (tiles == 1 ? 2 : 1) + (fold ? 2 : q->fp8 == MX_CODES ? 4 : 0) : 0;
        static tile_bf_fn *const tiles_of[2][7] = {
            {tile_bf1_0, tile_bf1_1, tile_bf1_2, tile_bf1_3, tile_bf1_4, tile_bf1_5, tile_bf1_6},
            {tile_bf2_0, tile_bf2_1, tile_bf2_2, tile_bf2_3, tile_bf2_4, tile_bf2_5, tile_bf2_6}};
        tiles_of[NP - 1][dq](
            x + r * ldx, ldx, (int)n, d, pairs, bs0, bs1, bpairs, first, pf + 64 * l0, l1 - l0, c + r * ldc, ldc, &qf);
    }
    free(heap);
}

/* Pairs dequantised at a time for format f: BF_CHUNK, whole FP8 blocks. */
static inline int64_t bf_chunk(const codes_fmt *f) {
    return !f->fp8 ? BF_CHUNK : BF_CHUNK > f->bpairs ? BF_CHUNK / f->bpairs * f->bpairs : f->bpairs;
}

/* c rows (ldc floats apart; [panel 0's 16 sums, panel 1's 16], unscaled for int8) = `rows` rows (at
 * most BF_ROWS) of bf16 x (ldx pairs apart) times panels pw0 and pw1 (NULL: pw0 alone) of format f (bs0,
 * bs1: their FP8 block scales). A chunk of pairs at a time, the first tile of rows dequantises the
 * panels into d (64-byte aligned, bf_chunk pairs of 128 bytes) and every other tile reads d, before
 * the next chunk; the sums kept in c between chunks; pf_lines lines from pf are prefetched into L2 on
 * the way. */
TBF static inline void panels_bf(const uint32_t *x, int64_t ldx, int64_t rows, const int8_t *pw0, const int8_t *pw1,
                                 int64_t pairs, const codes_fmt *f, const float *bs0, const float *bs1, const char *pf,
                                 int64_t pf_lines, uint16_t *d, float *c, int64_t ldc) {
    const int64_t ch = bf_chunk(f);
    for (int64_t j0 = 0; j0 < pairs; j0 += ch) {
        const int64_t n = pairs - j0 < ch ? pairs - j0 : ch, l0 = pf_lines * j0 / pairs;
        const bf_codes q = {pw0 + 32 * j0, pw1 ? pw1 + 32 * j0 : NULL, f->fp8, NULL, NULL, f->fold_rows};
        rows_bf(x + j0, ldx, rows, pw1 ? 2 : 1, d, n, f->fp8 ? bs0 + j0 / f->bpairs : NULL,
                f->fp8 && pw1 ? bs1 + j0 / f->bpairs : NULL, f->bpairs, j0 == 0, pf + 64 * l0,
                pf_lines * (j0 + n) / pairs - l0, c, ldc, &q);
    }
}
#endif

#if defined(HAVE_BF16DOT) /* (BF_ROWS, and a compiler new enough for both) */
#define HAVE_VNNI 1
#define TVN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define AIVN TVN static inline __attribute__((always_inline))
#define VN_CHUNK 1024 /* quads of two panels repacked at a time: 128 KiB, in L2 */
#define VN_SPLIT 4    /* rows up to which dotvn keeps the even and odd quads' sums apart */
#define VN_MAX_K 66000 /* inputs a sum may span: (127 + 128) * 127 * VN_MAX_K stays inside int32 */

/* VNNI (w8a8: int8 weights times int8 activations). A row of activations is quantised per row
 * (quant_row): scale = max |x| / 127, codes q = round(x * (127 / max |x|)) in [-127, 127], zero past
 * the row up to a whole quad of 4; after its codes, at byte `meta` of the row, the float32 scale and
 * the int32 sum of the codes. vpdpbusd multiplies unsigned by signed bytes, 4 at a time into each
 * int32 lane: the weights are the unsigned side, as q + 128 (their sign bit flipped), the row's codes
 * the signed side, so a lane sums (w + 128) x = w x + 128 x and 128 times the row's sum of codes comes
 * off at the end. Every product and sum is exact in int32 (inputs up to VN_MAX_K); the float32 result
 * is (sum - 128 rowsum) * row scale, rounded once, then the callers' epilogues apply the weights'
 * per-channel scales. Quad i of a panel (its pairs 2i and 2i + 1) as dpbusd reads it: lane o = the
 * 4 codes q[o][4i..4i+3] + 128, one word permute of the panel's 64 bytes. */

/* quad i of panel pw in dpbusd's layout; half: pair 2i + 1 lies past the panel (read as zero codes,
 * which meet zero activations) */
AIVN __m512i quad_u8(const int8_t *pw, int64_t i, const int half) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0); /* word 2o: o, 2o + 1: 16 + o */
    const __m512i z = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, pw + 64 * i) : _mm512_loadu_si512(pw + 64 * i);
    return _mm512_xor_si512(_mm512_permutexvar_epi16(idx, z), _mm512_set1_epi8((char)0x80));
}

/* Quad i of NP (1 or 2) panels for R rows of codes (row r at xr[r]): acc[r][k] += row r . panel k,
 * one broadcast of the row's 4 codes feeding both. DQ 1: the quad is repacked here from the codes q0
 * (q1) and stored into d (quad i of panel k at d + 64 (NP i + k)) on the way; 2: repacked, not stored
 * (no other tile follows); 0: read from d. */
AIVN void vn_quad(const int8_t *const *xr, const int R, const int NP, uint8_t *d, int64_t i, __m512i acc[][2],
                  const int8_t *q0, const int8_t *q1, const int half, const int DQ) {
    __m512i w0, w1;
    if (DQ) {
        w0 = quad_u8(q0, i, half), w1 = NP == 2 ? quad_u8(q1, i, half) : w0;
        if (DQ == 1) _mm512_store_si512(d + 64 * NP * i, w0);
        if (DQ == 1 && NP == 2) _mm512_store_si512(d + 128 * i + 64, w1);
    } else {
        w0 = _mm512_load_si512(d + 64 * NP * i);
        w1 = NP == 2 ? _mm512_load_si512(d + 128 * i + 64) : w0;
    }
    for (int r = 0; r < R; r++) {
        int32_t four;
        memcpy(&four, xr[r] + 4 * i, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
        if (NP == 2) acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
    }
}

/* s[r][k] (int32) += quads [0, nq) of R rows . panel k; the last quad half a quad where `half`. acc[s]:
 * the even quads (s = 0) and, up to VN_SPLIT rows, the odd ones: more chains in flight for few rows.
 * DQ: see vn_quad (the codes prefetched PF_LINES lines ahead). On the way it asks for pf_lines cache
 * lines from pf into L2, a few every two quads: codes the thread reads next (as dotbf_u does). */
AIVN void dotvn(const int8_t *const *xr, const int R, const int NP, uint8_t *d, int64_t nq, const int half,
                __m512i s[][2], const int8_t *q0, const int8_t *q1, const char *pf, int64_t pf_lines, const int DQ) {
    const int S = R <= VN_SPLIT ? 2 : 1;
    __m512i acc[2][MAX_R512][2];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NP; k++) acc[0][r][k] = s[r][k], acc[1][r][k] = _mm512_setzero_si512();
    const int64_t full = nq - half, steps = full / 2 > 0 ? full / 2 : 1;
    const int64_t per = (pf_lines + steps - 1) / steps; /* lines a step */
    const char *pf_end = pf + 64 * pf_lines;
    int64_t i = 0;
    for (; i + 2 <= full; i += 2) {
        for (int64_t l = 0; l < per && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        if (DQ) { /* a quad is a line of each panel */
            _mm_prefetch((const char *)(q0 + (i + PF_LINES) * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(q0 + (i + 1 + PF_LINES) * 64), _MM_HINT_T0);
            if (NP == 2) _mm_prefetch((const char *)(q1 + (i + PF_LINES) * 64), _MM_HINT_T0);
            if (NP == 2) _mm_prefetch((const char *)(q1 + (i + 1 + PF_LINES) * 64), _MM_HINT_T0);
        }
        vn_quad(xr, R, NP, d, i, acc[0], q0, q1, 0, DQ);
        vn_quad(xr, R, NP, d, i + 1, acc[S - 1], q0, q1, 0, DQ);
    }
    if (i < full) vn_quad(xr, R, NP, d, i++, acc[0], q0, q1, 0, DQ);
    if (half) vn_quad(xr, R, NP, d, i, acc[0], q0, q1, 1, DQ);
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NP; k++) s[r][k] = S == 2 ? _mm512_add_epi32(acc[0][r][k], acc[1][r][k]) : acc[0][r][k];
}

/* c rows (ldc int32 apart; [panel 0's 16 sums, panel 1's 16]) of R rows: set (first) or added to. */
AIVN void tile_vn(const int8_t *x, int64_t ldx, const int R, const int NP, uint8_t *d, int64_t nq, int half,
                  int first, int32_t *c, int64_t ldc, const int8_t *q0, const int8_t *q1, const char *pf,
                  int64_t pf_lines, const int DQ) {
    __m512i s[MAX_R512][2];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NP; k++)
            s[r][k] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(c + r * ldc + 16 * k);
    const int8_t *xr[MAX_R512]; /* row pointers: one register each in the dots' loops */
    for (int r = 0; r < R; r++) xr[r] = x + r * ldx;
    dotvn(xr, R, NP, d, nq, half, s, q0, q1, pf, pf_lines, DQ);
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NP; k++) _mm512_storeu_si512(c + r * ldc + 16 * k, s[r][k]);
}

#define TILE_VN_ARGS \
    const int8_t *x, int64_t ldx, int R, uint8_t *d, int64_t nq, int half, int first, int32_t *c, int64_t ldc, \
        const int8_t *q0, const int8_t *q1, const char *pf, int64_t pf_lines
#define TILE_VN(np, dq) \
    TVN static void tile_vn##np##_##dq(TILE_VN_ARGS) { BY_ROWS(R, TILE_VN_##np##_##dq) }
#define TILE_VN_CALL(n, np, dq) tile_vn(x, ldx, n, np, d, nq, half, first, c, ldc, q0, q1, pf, pf_lines, dq)
#define TILE_VN_1_0(n) TILE_VN_CALL(n, 1, 0)
#define TILE_VN_2_0(n) TILE_VN_CALL(n, 2, 0)
#define TILE_VN_1_1(n) TILE_VN_CALL(n, 1, 1)
#define TILE_VN_2_1(n) TILE_VN_CALL(n, 2, 1)
#define TILE_VN_1_2(n) TILE_VN_CALL(n, 1, 2)
#define TILE_VN_2_2(n) TILE_VN_CALL(n, 2, 2)
TILE_VN(1, 0)
TILE_VN(2, 0)
TILE_VN(1, 1)
TILE_VN(2, 1)
TILE_VN(1, 2)
TILE_VN(2, 2)
#undef TILE_VN_1_0
#undef TILE_VN_2_0
#undef TILE_VN_1_1
#undef TILE_VN_2_1
#undef TILE_VN_1_2
#undef TILE_VN_2_2
#undef TILE_VN_CALL
#undef TILE_VN
#undef TILE_VN_ARGS

/* c rows (ldc floats apart; [panel 0's 16 sums, panel 1's 16]) = `rows` rows of quantised codes (ldx
 * bytes apart, each with its scale and sum at byte `meta`) times int8 panels pw0 and pw1 (NULL: pw0
 * alone) of `pairs` pairs, as float32 (sum - 128 rowsum) * row scale: the weights' scales left to the
 * epilogue. A chunk of quads at a time, the first tile of rows (up to MAX_R512, as even as they go)
 * repacks the chunk into d (64-byte aligned, 2 VN_CHUNK quads of 64 bytes) as it dots it and every
 * other tile reads d; int32 sums kept in c between chunks. The tiles ask for pf_lines lines from pf
 * into L2 on the way, each its share. */
TVN static inline void panels_vn(const int8_t *x, int64_t ldx, int64_t rows, const int8_t *pw0, const int8_t *pw1,
                                 int64_t pairs, int64_t meta, const char *pf, int64_t pf_lines, uint8_t *d, float *c,
                                 int64_t ldc) {
    const int NP = pw1 ? 2 : 1;
    const int64_t quads = (pairs + 1) / 2, tiles = (rows + MAX_R512 - 1) / MAX_R512;
    int32_t *ci = (int32_t *)c;
    const int64_t shares = tiles * ((quads + VN_CHUNK - 1) / VN_CHUNK); /* tiles run, each a share of pf */
    int64_t run = 0;
    for (int64_t i0 = 0; i0 < quads; i0 += VN_CHUNK) {
        const int64_t nq = quads - i0 < VN_CHUNK ? quads - i0 : VN_CHUNK;
        const int half = i0 + nq == quads && (pairs & 1);
        const int8_t *q0 = pw0 + 64 * i0, *q1 = pw1 ? pw1 + 64 * i0 : NULL;
        for (int64_t r = 0, ti = 0, n; r < rows; r += n, ti++) {
            n = (rows - r + (tiles - ti) - 1) / (tiles - ti);
            const int64_t l0 = pf_lines * run / shares, l1 = pf_lines * (run + 1) / shares;
            run++;
            (NP == 2 ? (ti ? tile_vn2_0 : tiles > 1 ? tile_vn2_1 : tile_vn2_2)
                     : (ti ? tile_vn1_0 : tiles > 1 ? tile_vn1_1 : tile_vn1_2))(
                x + r * ldx + 4 * i0, ldx, (int)n, d, nq, half, i0 == 0, ci + r * ldc, ldc, q0, q1, pf + 64 * l0,
                l1 - l0);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float scale;
        int32_t sum;
        memcpy(&scale, x + r * ldx + meta, 4);
        memcpy(&sum, x + r * ldx + meta + 4, 4);
        const __m512i off = _mm512_set1_epi32(128 * sum);
        for (int k = 0; k < NP; k++) {
            const __m512i s = _mm512_sub_epi32(_mm512_loadu_si512(ci + r * ldc + 16 * k), off);
            _mm512_storeu_ps(c + r * ldc + 16 * k, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(scale)));
        }
    }
}

/* A row of n values (float32, or bf16 where bf16) quantised for panels_vn into q: its codes, zeros up to
 * `width` (a multiple of 4, at least n), and at q + width its scale and the sum of its codes. q may be
 * the row itself (the codes land at or before the values they replace, after those are read). */
TVN static inline void quant_row(const void *v, int bf16, int64_t n, int64_t width, int8_t *q) {
    __m512 amax = _mm512_setzero_ps();
    int64_t i = 0;
#define VN_LOAD(i, m) (bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)v + (i))), 16)) \
                            : _mm512_maskz_loadu_ps(m, (const float *)v + (i)))
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(VN_LOAD(i, m)));
    }
    const float a = _mm512_reduce_max_ps(amax), scale = a / 127.0f, inv = a > 0.0f ? 127.0f / a : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    const __m512 iv = _mm512_set1_ps(inv);
    for (i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(VN_LOAD(i, m), iv)); /* to nearest even */
        c = _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        sum = _mm512_add_epi32(sum, c);
        _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(c));
    }
#undef VN_LOAD
    const int32_t total = _mm512_reduce_add_epi32(sum);
    memset(q + n, 0, (size_t)(width - n));
    memcpy(q + width, &scale, 4);
    memcpy(q + width + 4, &total, 4);
}
#endif

#if (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11) && defined(HAVE_BF16DOT) && defined(__x86_64__)
#define HAVE_AMX 1
#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#define AMX_ROWS 32 /* rows of one block of tiles: 2 A tiles of 16 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* every tile 16 rows x 64 bytes (a constant: ldtilecfg's operand does not tell the compiler that the
 * 64 bytes are read, so stores to a stack copy may be dropped) */
static const tile_config TILES = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

/* The calling thread's tiles configured / released (after shuttle_int8_amx_init granted them). */
TAMX static inline void amx_begin(void) { _tile_loadconfig(&TILES); }
TAMX static inline void amx_end(void) { _tile_release(); }

/* A panel dequantised for B tiles: its `pairs` pairs, then zero pairs up to kb * 16. */
TAMX static inline void dequant_tiles(const int8_t *pw, int64_t pairs, int64_t kb, uint16_t *d, const int fp8) {
    dequant_bf16(pw, pairs, d, fp8);
    memset(d + 32 * pairs, 0, 64 * (size_t)(kb * 16 - pairs));
}

/* c (32 x 32 float32) = 16 or 32 (two) rows of a (bf16, lda_bytes apart, kb * 32 values each) times
 * two dequantised panels b0, b1 (kb * 16 pairs each): tiles 0-3 = (row tile, panel). A panel's 16
 * pairs are one B tile, 16 rows (pairs) x 64 bytes (16 outputs x 2), contiguous. */
TAMX static inline void amx_block(const uint16_t *a, int64_t lda_bytes, const uint16_t *b0, const uint16_t *b1,
                                  int64_t kb, int two, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const char *a0 = (const char *)a, *a1 = a0 + 16 * lda_bytes;
    for (int64_t k = 0; k < kb; k++) {
        _tile_loadd(6, b0 + k * 512, 64);
        _tile_loadd(7, b1 + k * 512, 64);
        _tile_loadd(4, a0 + k * 64, lda_bytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + k * 64, lda_bytes);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
}

/* amx_block on FP8 panels: c (32 x 32) = sum over the blocks of bk k-steps (bpairs / 16: blocks of whole
 * tiles) of each block's tiles times its scales, bs0[b] for panel b0's columns, bs1[b] for b1's. The
 * tiles are stored once per block and added into c with AVX-512. */
TAMX static inline void amx_block_fp8(const uint16_t *a, int64_t lda_bytes, const uint16_t *b0, const uint16_t *b1,
                                      int64_t kb, int two, float *c, int64_t bk, const float *bs0, const float *bs1) {
    float part[AMX_ROWS * 32] __attribute__((aligned(64)));
    const int rows = two ? 32 : 16;
    for (int i = 0; i < rows * 32; i += 16) _mm512_store_ps(c + i, _mm512_setzero_ps());
    for (int64_t k0 = 0, b = 0; k0 < kb; k0 += bk, b++) {
        const int64_t n = kb - k0 < bk ? kb - k0 : bk;
        amx_block((const uint16_t *)((const char *)a + k0 * 64), lda_bytes, b0 + k0 * 512, b1 + k0 * 512, n, two, part);
        const __m512 s0 = _mm512_set1_ps(bs0[b] * FP8_UNIT), s1 = _mm512_set1_ps(bs1[b] * FP8_UNIT);
        for (int r = 0; r < rows; r++) {
            _mm512_store_ps(c + 32 * r, _mm512_fmadd_ps(_mm512_load_ps(part + 32 * r), s0, _mm512_load_ps(c + 32 * r)));
            _mm512_store_ps(c + 32 * r + 16,
                            _mm512_fmadd_ps(_mm512_load_ps(part + 32 * r + 16), s1, _mm512_load_ps(c + 32 * r + 16)));
        }
    }
}
#endif
#endif

#endif
