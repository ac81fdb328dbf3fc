/* MXFP4 panels (mxfp4_gemm.c's layout: 16 output rows, blocks of 32 inputs, 256 code bytes and 16
 * E8M0 scale bytes a block) decoded in registers by the AVX2 and AVX-512 kernels, shared by mxfp4_gemm.c (the
 * linear) and moe_int8.c (the fused MXFP4 MoE block):
 *  mx_dot256, mx_dot512  R rows of float32 x times one panel, FP4 values widened to float32 (the FMA
 *                   kernels, AVX2 and AVX-512);
 *  mx_dequant_bf16  blocks of a panel decoded to bf16 with their scales folded in, into int8_panels.h's
 *                   bf16 pair layout, which its BF16DOT tiles (rows_bf) read;
 *  panels_mx        one or two panels through mx_dequant_bf16 and rows_bf, a chunk of blocks at a time. */
#ifndef SHUTTLE_MXFP4_PANELS_H
#define SHUTTLE_MXFP4_PANELS_H
#include "int8_panels.h"

#define MX_BLOCK 32        /* inputs per E8M0 scale */
#define MX_PANEL_BLOCK 256 /* bytes of one panel's block: 16 pairs x 16 rows */

/* 8 E8M0 bytes as float32 2^(e - 127) (e = 0: 2^-127, the subnormal 0x400000) */
static inline __attribute__((always_inline)) __m256 e8m0x8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
    return _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x400000), zero));
}

/* Half h of a panel's pair (8 bytes, lane = row 8h + lane) as FP4 values: w0 input 2j, w1 input 2j + 1;
 * table: the magnitudes of codes 0-7 */
static inline __attribute__((always_inline)) void fp4_half8(const uint8_t *p, __m256 table, __m256 *w0, __m256 *w1) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), sign = _mm256_set1_epi32(INT32_MIN);
    *w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, b),
                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 28), sign)));
    *w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, _mm256_srli_epi32(b, 4)),
                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 24), sign)));
}

/* sum[r][h]: rows 8h..8h+7 of the panel times x row r, each block's partial sums times its scales.
 * acc[k][r][h]: input 2j's products and, up to 2 rows (k = 1), input 2j + 1's apart (more chains of
 * FMAs in flight where few rows give few; 3 rows of them would not fit the 16 registers). */
static inline __attribute__((always_inline)) void mx_dot256(const float *x, int64_t ldx, const int R, const uint8_t *pw,
                                                            const uint8_t *ps, int64_t G, __m256 sum[][2]) {
    const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const int S = R <= 2 ? 2 : 1;
    for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *pb = pw + g * MX_PANEL_BLOCK;
        const float *xb = x + g * MX_BLOCK;
        __m256 acc[2][MAX_R2][2];
        for (int k = 0; k < S; k++)
            for (int r = 0; r < R; r++) acc[k][r][0] = acc[k][r][1] = _mm256_setzero_ps();
        for (int j = 0; j < 16; j++) {
            if (!(j & 3)) _mm_prefetch((const char *)(pb + 16 * j + 64 * PF_LINES), _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                __m256 w0, w1;
                fp4_half8(pb + 16 * j + 8 * h, table, &w0, &w1);
                for (int r = 0; r < R; r++) {
                    acc[0][r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + 2 * j]), w0, acc[0][r][h]);
                    acc[S - 1][r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xb[r * ldx + 2 * j + 1]), w1, acc[S - 1][r][h]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 s = e8m0x8(ps + 16 * g + 8 * h);
            for (int r = 0; r < R; r++) {
                const __m256 part = S == 2 ? _mm256_add_ps(acc[0][r][h], acc[1][r][h]) : acc[0][r][h];
                sum[r][h] = _mm256_fmadd_ps(part, s, sum[r][h]);
            }
        }
    }
}

#ifdef HAVE_AVX512
/* The FP4 (E2M1) value of each code 0-15 (kernels/quant.py: FP4_VALUES) */
AI512 __m512 fp4_table(void) {
    return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                          -4.0f, -6.0f);
}

/* 16 E8M0 bytes as float32 2^(e - 127) (e = 0: 2^-127, the subnormal 0x400000) */
AI512 __m512 e8m0x16(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(zero, _mm512_slli_epi32(e, 23), _mm512_set1_epi32(0x400000)));
}

/* One pair of a panel (16 bytes, lane = row) as FP4 values: w0 input 2j, w1 input 2j + 1 */
AI512 void fp4_pair(const uint8_t *p, __m512 table, __m512 *w0, __m512 *w1) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *w0 = _mm512_permutexvar_ps(b, table);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

/* One pair of a panel for R rows of x (x[r * ldx], x[r * ldx + 1]: the pair's inputs): acc[r][0] (input
 * 2j) and acc[r][1] (input 2j + 1) += w x */
AI512 void mx_pair512(const uint8_t *p, __m512 table, const float *x, int64_t ldx, const int R, __m512 acc[][2]) {
    __m512 w0, w1;
    fp4_pair(p, table, &w0, &w1);
    for (int r = 0; r < R; r++) {
        acc[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx]), w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 1]), w1, acc[r][1]);
    }
}

/* sum[r] (lane = row of the panel) = x row r (float32, rows ldx apart) . the panel's G blocks, each
 * block's partial sums times its 16 row scales. acc[k][r]: the even pairs' (k = 0) and, up to SPLIT_R
 * rows, the odd pairs' (k = 1) products, two per pair (inputs 2j and 2j + 1): more chains of FMAs in
 * flight where few rows give few. */
AI512 void mx_dot512(const float *x, int64_t ldx, const int R, const uint8_t *pw, const uint8_t *ps, int64_t G,
                     __m512 sum[]) {
    const __m512 table = fp4_table();
    const int S = R <= SPLIT_R ? 2 : 1;
    for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *pb = pw + g * MX_PANEL_BLOCK;
        const float *xb = x + g * MX_BLOCK;
        __m512 acc[2][MAX_R512][2];
        for (int k = 0; k < S; k++)
            for (int r = 0; r < R; r++) acc[k][r][0] = acc[k][r][1] = _mm512_setzero_ps();
        for (int j = 0; j < 16; j += 2) { /* (k a constant: the accumulators stay in registers) */
            if (!(j & 3)) _mm_prefetch((const char *)(pb + 16 * j + 64 * PF_LINES), _MM_HINT_T0);
            mx_pair512(pb + 16 * j, table, xb + 2 * j, ldx, R, acc[0]);
            mx_pair512(pb + 16 * j + 16, table, xb + 2 * j + 2, ldx, R, acc[S - 1]);
        }
        const __m512 s = e8m0x16(ps + 16 * g);
        for (int r = 0; r < R; r++) {
            __m512 part = _mm512_add_ps(acc[0][r][0], acc[0][r][1]);
            if (S == 2) part = _mm512_add_ps(part, _mm512_add_ps(acc[1][r][0], acc[1][r][1]));
            sum[r] = _mm512_fmadd_ps(part, s, sum[r]);
        }
    }
}
#endif

#ifdef HAVE_BF16DOT
/* Blocks [g0, g1) of a panel decoded into d as bf16 pairs with the scales folded in, pair j of the
 * blocks at d + step * j (64-byte aligned; step 32: the panel alone, 64: one of two side by side, see
 * int8_panels.h's bf_pair): lane o = (w[o][2j], w[o][2j + 1]). Every value is an FP4 value times a power
 * of two, so bf16 holds it exactly where it is normal: a block whose 16 scale bytes are all in [2, 252]
 * (every product then normal, or zero) takes each code's bf16 value from a 16-word table (vpermw of the
 * byte's two nibbles, one word each) and adds e - 127 to the exponent field of the nonzero words; other
 * blocks (products under 2^-126 or past bf16's range) multiply in float32 and keep the top halves. The
 * two give the same bits where both apply. */
TBF static void mx_dequant_bf16(const uint8_t *pw, const uint8_t *ps, int64_t g0, int64_t g1, uint16_t *d, int64_t step) {
    const __m512 table = fp4_table();
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    uint8_t add[64] __attribute__((aligned(64)));
    for (int64_t g = g0; g < g1; g++) {
        if (mx_block_add(ps + 16 * g, add)) {
            for (int j = 0; j < 16; j++) {
                const uint8_t *p = pw + g * MX_PANEL_BLOCK + 16 * j;
                if (!(j & 3)) _mm_prefetch((const char *)(p + 64 * PF_LINES), _MM_HINT_T0);
                _mm512_store_si512(d + step * ((g - g0) * 16 + j), mx_pair_bf16(p, _mm512_load_si512(add)));
            }
            continue;
        }
        const __m512 s = e8m0x16(ps + 16 * g);
        for (int j = 0; j < 16; j++) {
            const uint8_t *p = pw + g * MX_PANEL_BLOCK + 16 * j;
            if (!(j & 3)) _mm_prefetch((const char *)(p + 64 * PF_LINES), _MM_HINT_T0);
            __m512 w0, w1;
            fp4_pair(p, table, &w0, &w1);
            const __m512i a = _mm512_castps_si512(_mm512_mul_ps(w0, s)), b = _mm512_castps_si512(_mm512_mul_ps(w1, s));
            const __m512i pair = _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, top));
            _mm512_store_si512(d + step * ((g - g0) * 16 + j), pair);
        }
    }
}

/* Blocks of a panel (16 pairs each) decoded at a time: BF_CHUNK pairs, at most the panel's G. */
static inline int64_t mx_chunk_blocks(int64_t G) {
    const int64_t b = BF_CHUNK / 16 > 1 ? BF_CHUNK / 16 : 1;
    return G < b ? G : b;
}

/* c rows (ldc floats apart; [panel 0's 16 sums, panel 1's 16]) = `rows` rows (at most BF_ROWS) of bf16 x
 * (ldx pairs apart) times the G blocks of panel pw0 (scales ps0) and pw1 (ps1; NULL: pw0 alone), as
 * BF16DOT computes mxfp4_linear: a chunk of blocks at a time (mx_chunk_blocks), every tile of rows
 * (rows_bf) reading the chunk's bf16 copy in d (64-byte aligned, 128 bytes a pair), the sums kept in c
 * between chunks; pf_lines lines from pf are prefetched into L2 on the way. The first tile decodes the
 * chunk into d as it dots it (mx_pair_bf16: the decode overlaps its dot products), or where a block's
 * scales leave bf16's normal range mx_dequant_bf16 decodes the chunk first. */
TBF static inline void panels_mx(const uint32_t *x, int64_t ldx, int64_t rows, const uint8_t *pw0,
                                 const uint8_t *ps0, const uint8_t *pw1, const uint8_t *ps1, int64_t G, uint16_t *d,
                                 const char *pf, int64_t pf_lines, float *c, int64_t ldc) {
    const int64_t gch = mx_chunk_blocks(G);
    uint8_t adds[2][BF_CHUNK / 16][64] __attribute__((aligned(64))); /* each block's mx_block_add, per panel */
    for (int64_t g0 = 0; g0 < G; g0 += gch) {
        const int64_t g1 = G - g0 < gch ? G : g0 + gch, l0 = pf_lines * g0 / G, lines = pf_lines * g1 / G - l0;
        int normal = 1;
        for (int64_t g = g0; g < g1 && normal; g++)
            normal = mx_block_add(ps0 + 16 * g, adds[0][g - g0]) && (!pw1 || mx_block_add(ps1 + 16 * g, adds[1][g - g0]));
        if (normal) {
            const bf_codes q = {(const int8_t *)(pw0 + g0 * MX_PANEL_BLOCK),
                                pw1 ? (const int8_t *)(pw1 + g0 * MX_PANEL_BLOCK) : NULL, MX_CODES, adds[0][0],
                                adds[1][0], INT64_MAX};
            rows_bf(x + g0 * 16, ldx, rows, pw1 ? 2 : 1, d, (g1 - g0) * 16, NULL, NULL, 0, g0 == 0, pf + 64 * l0, lines,
                    c, ldc, &q);
            continue;
        }
        mx_dequant_bf16(pw0, ps0, g0, g1, d, pw1 ? 64 : 32);
        if (pw1) mx_dequant_bf16(pw1, ps1, g0, g1, d + 32, 64);
        rows_bf(x + g0 * 16, ldx, rows, pw1 ? 2 : 1, d, (g1 - g0) * 16, NULL, NULL, 0, g0 == 0, pf + 64 * l0, lines, c,
                ldc, &NO_CODES);
    }
}
#endif
#endif
