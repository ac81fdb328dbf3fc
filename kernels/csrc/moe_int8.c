/* The whole MoE block of one layer in one call on weight-only int8 experts, FP8 E4M3 ones with block
 * scales (shuttle_fused_moe_fp8: kernels/fp8_weights.py, the same loops on int8_panels.h's codes_fmt)
 * or MXFP4 ones (shuttle_fused_moe_mxfp4, below), x and y in float32 or bfloat16 (kernels/int8.py:
 * fused_moe_int8 on Int8ExpertPanels):
 *     y[t] = sum over t's top-k experts e of w[t,k] * (silu(x[t] W1_e^T) * (x[t] W3_e^T)) W2_e^T
 * with W = q * scale (int8 codes, one float32 scale per output channel), float32 accumulation. For
 * bf16 x it rounds to bf16 wherever kernels/moe.py's fused_moe_packed on int8 weights rounds (each
 * int8_linear output, silu(gate), the product, the weighted output, every partial sum of a token's
 * outputs, added in ascending expert id as unpermute's index_add_ adds); for float32 x nowhere. So
 * the two differ only in summation order and in how exp rounds.
 *
 * The algorithm is moe_avx512bf16.c's, on int8_panels.h's inner loops:
 *  1. a counting sort of the T*K (token, expert) pairs by expert (stable); ids outside [0, E) are
 *     skipped (an expert worker's pairs for other workers);
 *  2. the pairs' x rows gathered in that order, in the format their expert's kernel reads (float32
 *     for AVX2 / AVX512, bf16 for BF16DOT / AMX; zero-padded to its width);
 *  3. the gate/up GEMM with SiLU(gate) * up in its epilogue: W13's rows are reordered so that panels
 *     2u and 2u + 1 hold 16 gate rows and the same 16 up rows (Int8ExpertPanels, each half padded
 *     with zero rows to I16, a multiple of 16: h = silu(0) * 0 = 0 there); threads claim (expert,
 *     block of rows, panel pair) items in chunks as they go, each its next chunk as it starts one
 *     (so that BF16DOT's dots know the item after the current one, to prefetch its codes);
 *  4. the down GEMM, each thread owning a range of whole pairs of 16-column output panels and
 *     walking every expert in ascending id for its columns, adding the weighted rows into y: no two
 *     threads write one value, and each value's sum has one order whatever the thread count.
 * MXFP4 experts (shuttle_fused_moe_mxfp4, at the end) run the same loops on mxfp4_panels.h's panels:
 * W13's gate panel u and up panel u are I / 16 panels apart (the checkpoint's row order), the FMA
 * kernels are mx_dot256 / mx_dot512 and BF16DOT panels_mx, and the epilogues add each expert's biases
 * and take gpt-oss's clamped SwiGLU (up_store_mx, up_store_mx16). One region rather than two linear
 * calls per expert and passes for the activation and the weighted sum: 256 tokens of 8 x 1024 x 2048
 * top-2 experts took 1.24x the bf16 block's time the other way, 1.04-1.09x this way with BF16DOT's
 * decode in its first tile of rows (Zen 5 EPYC).
 * w8a8 (kernel VNNI, int8 codes only): gather quantises each x row per row (int8_panels.h's quant_row),
 * the up epilogue writes h in x's dtype, and after the up phase each thread quantises its share of h's
 * rows in place (one more barrier) before the down GEMM reads them; both GEMMs are panels_vn.
 * Kernels per expert (`kernel` below big_rows rows, `big_kernel` from there; int8_panels.h): AVX2 or
 * AVX512 (codes widened to float32 in registers, FMA), or for bf16 x BF16DOT or AMX (panels
 * dequantised to bf16 once per block of rows, then AVX-512 BF16 dot products or AMX tiles; both take
 * two panels at once: an item's gate and up panels, or neighbouring output panels of the down GEMM).
 * BF16DOT's dots prefetch the codes the thread takes next (the next item's panels, the next pair of
 * output panels, or the next expert's first pair) into L2 while they compute. Blocks of rows: their
 * x or h (about X_BLOCK_BYTES, BF16DOT at most BF_ROWS rows) stays in L2 while each panel streams past
 * once. The epilogues run once per 16 outputs of a row (the dots once per pair): AVX2 for the FMA
 * kernels, AVX-512 for the others. */
#include "mxfp4_panels.h"
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define X_BLOCK_BYTES (1 << 20)
#define UP_CHUNK 4 /* up items (panel pairs) a thread claims at once: neighbouring panels, one stream */
#define C_ROWS 32  /* rows of the epilogue's buffer of sums: one AMX block, or one FMA tile */
#define BUCKETS 12 /* row buckets of kernels/native.BUCKET_ROWS (1, 2, 3-4, ..., over 1024) */

int shuttle_int8_kernels(void);   /* int8_gemm.c: the kernels this build has */
int shuttle_int8_amx_ready(void); /* int8_gemm.c: whether this process may use the tiles */

/* c rows (ldc floats apart) = the 16 sums of R rows of float32 x (ldx values apart) times one panel's
 * codes (AVX2, AVX512; FP8: its block scales bs, bpairs pairs each, applied). Unscaled for int8 (the
 * epilogues scale). */
typedef void (*dot_fn)(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                       int64_t bpairs, float *c, int64_t ldc); /* bs: FP8 block scales, NULL for int8 */

static inline __attribute__((always_inline)) void dot256_c(const float *x, int64_t ldx, const int R, const int8_t *pw,
                                                           int64_t pairs, const int fp8, const float *bs,
                                                           int64_t bpairs, float *c, int64_t ldc) {
    __m256 sum[MAX_R2][2];
    dot256(x, ldx, R, pw, pairs, sum, fp8, bs, bpairs);
    for (int r = 0; r < R; r++) _mm256_storeu_ps(c + r * ldc, sum[r][0]), _mm256_storeu_ps(c + r * ldc + 8, sum[r][1]);
}

#define CALL(n) dot256_c((const float *)x, ldx, n, (const int8_t *)pw, pairs, FP8, bs, bpairs, c, ldc)
#define FP8 0
static void dot_avx2(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs, int64_t bpairs,
                     float *c, int64_t ldc) {
    BY_ROWS3(R, CALL)
}
#undef FP8
#define FP8 1
static void dot_avx2_fp8(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                         int64_t bpairs, float *c, int64_t ldc) {
    BY_ROWS3(R, CALL)
}
#undef FP8
#undef CALL

#ifdef HAVE_AVX512
AI512 void dot512_c(const float *x, int64_t ldx, const int R, const int8_t *pw, int64_t pairs, const int fp8,
                    const float *bs, int64_t bpairs, float *c, int64_t ldc) {
    __m512 sum[MAX_R512];
    dot512(x, ldx, R, pw, pairs, sum, fp8, bs, bpairs);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(c + r * ldc, sum[r]);
}

#define CALL(n) dot512_c((const float *)x, ldx, n, (const int8_t *)pw, pairs, FP8, bs, bpairs, c, ldc)
#define FP8 0
T512 static void dot_avx512(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                            int64_t bpairs, float *c, int64_t ldc) {
    BY_ROWS(R, CALL)
}
#undef FP8
#define FP8 1
T512 static void dot_avx512_fp8(const void *x, int64_t ldx, int R, const void *pw, int64_t pairs, const float *bs,
                                int64_t bpairs, float *c, int64_t ldc) {
    BY_ROWS(R, CALL)
}
#undef FP8
#undef CALL
#endif

/* One row's h[0..16): silu(gate) * up from its 16 gate sums c[0..16) and 16 up sums c[16..32), scaled
 * by gs and us; round: bf16 x, rounded where torch rounds (gate, up, silu(gate), the product). h is
 * float32 (the FMA kernels' input) or bf16 (h_bf16: BF16DOT's and AMX's). */
static inline void up_store(const float *c, const float *gs, const float *us, int round, void *h, int h_bf16) {
    for (int k = 0; k < 2; k++) {
        __m256 g = _mm256_mul_ps(_mm256_loadu_ps(c + 8 * k), _mm256_loadu_ps(gs + 8 * k));
        __m256 u = _mm256_mul_ps(_mm256_loadu_ps(c + 16 + 8 * k), _mm256_loadu_ps(us + 8 * k));
        if (round) g = rbf8(g), u = rbf8(u);
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        if (round) s = rbf8(s);
        const __m256 v = _mm256_mul_ps(s, u);
        if (h_bf16) store_bf8((uint16_t *)h + 8 * k, v);
        else _mm256_storeu_ps((float *)h + 8 * k, round ? rbf8(v) : v);
    }
}

/* y[0..nv) += w * (the 16 sums c scaled, plus bias where not NULL); round (bf16 y): the expert's output,
 * its weighted value and the sum each rounded to bf16, as int8_linear, unpermute's product and
 * index_add_ round. */
static inline void down_store(const float *c, const float *scale, const float *bias, float w, void *y, int nv,
                              int round) {
    float prev[PANEL] = {0}, out[PANEL];
    if (nv < PANEL)
        for (int o = 0; o < nv; o++) prev[o] = round ? bf16_to_f32(((const uint16_t *)y)[o]) : ((const float *)y)[o];
    const __m256 wv = _mm256_set1_ps(w);
    for (int k = 0; k < 2; k++) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(c + 8 * k), _mm256_loadu_ps(scale + 8 * k));
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * k)); /* (MXFP4: nv is PANEL) */
        if (round) v = rbf8(v);
        v = _mm256_mul_ps(v, wv);
        if (round) v = rbf8(v);
        const __m256 p = nv < PANEL ? _mm256_loadu_ps(prev + 8 * k)
                         : round    ? bf16x8_to_f32((const uint16_t *)y + 8 * k)
                                    : _mm256_loadu_ps((const float *)y + 8 * k);
        v = _mm256_add_ps(p, v);
        if (nv < PANEL) _mm256_storeu_ps(out + 8 * k, round ? rbf8(v) : v);
        else if (round) store_bf8((uint16_t *)y + 8 * k, v);
        else _mm256_storeu_ps((float *)y + 8 * k, v);
    }
    if (nv < PANEL)
        for (int o = 0; o < nv; o++) {
            if (round) {
                uint32_t u;
                memcpy(&u, out + o, 4);
                ((uint16_t *)y)[o] = (uint16_t)(u >> 16);
            } else {
                ((float *)y)[o] = out[o];
            }
        }
}

#ifdef HAVE_AVX512
/* up_store and down_store sixteen lanes at a time, for the kernels that need AVX-512 anyway (BF16DOT,
 * VNNI, AMX): the same operations on the same values, so the same bits (exp16 is exp8's, the rounding
 * round_bits8's), in half the instructions. At 64 rows per expert the AVX2 epilogues were 9% of the
 * fused FP8 block's time (perf, 256 tokens of 8 x 1024 x 2048 top-2, Zen 5 EPYC). */
AI512 __m512i round_bits16(__m512 f) { /* the rounded bf16 in each lane's top half */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u));
}
AI512 __m512 rbf16x(__m512 f) { return _mm512_castsi512_ps(round_bits16(f)); }
AI512 __m256i bf16_bits16(__m512 f) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits16(f), 16)); }

AI512 void up_store16(const float *c, const float *gs, const float *us, int round, void *h, int h_bf16) {
    __m512 g = _mm512_mul_ps(_mm512_loadu_ps(c), _mm512_loadu_ps(gs));
    __m512 u = _mm512_mul_ps(_mm512_loadu_ps(c + 16), _mm512_loadu_ps(us));
    if (round) g = rbf16x(g), u = rbf16x(u);
    __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    if (round) s = rbf16x(s);
    const __m512 v = _mm512_mul_ps(s, u);
    if (h_bf16) _mm256_storeu_si256((__m256i *)h, bf16_bits16(v));
    else _mm512_storeu_ps((float *)h, round ? rbf16x(v) : v);
}

AI512 void down_store16(const float *c, const float *scale, const float *bias, float w, void *y, int nv, int round) {
    const __mmask16 m = nv < PANEL ? (__mmask16)((1u << nv) - 1) : (__mmask16)0xFFFF;
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(c), _mm512_loadu_ps(scale));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias)); /* (MXFP4: the linear's bias, then rounded) */
    if (round) v = rbf16x(v);
    v = _mm512_mul_ps(v, _mm512_set1_ps(w));
    if (round) v = rbf16x(v);
    if (round) {
        const __m512 p = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)y)), 16));
        _mm256_mask_storeu_epi16((uint16_t *)y, m, bf16_bits16(_mm512_add_ps(p, v)));
    } else {
        _mm512_mask_storeu_ps((float *)y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, (const float *)y), v));
    }
}
#endif

/* MXFP4 experts (shuttle_fused_moe_mxfp4's): W13 (2I, D) with the gate rows then the up
 * rows and W2 (D, I) in mxfp4_gemm.c's panels, each expert's float32 biases (b13[e], b2[e]: addresses,
 * 0 none; NULL: no expert has), and kernels/moe.SwiGLU's constants (silu: alpha 1 and no up offset). */
typedef struct {
    const int64_t *b13, *b2;
    float alpha, limit, up_offset;
    int silu, clamp; /* clamp: a finite limit (bf16 x: the limit rounded to bf16, as a bf16 clamp gives) */
} mx_args;

/* One row's 16 h values of MXFP4 experts from its 16 gate and 16 up sums c plus their biases (bg, bu;
 * NULL: none), through SwiGLU as kernels/moe.SwiGLU's torch ops compute it: each linear's output
 * rounded (round: bf16 x), then every op of the activation rounded as its torch op (the AVX2 kernel's
 * epilogue; up_store_mx16 the AVX-512 one, the same operations). */
static inline void up_store_mx(const float *c, const float *bg, const float *bu, const mx_args *a, int round, void *h,
                               int h_bf16) {
    const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(a->limit), nlim = _mm256_set1_ps(-a->limit);
    for (int k = 0; k < 2; k++) {
        __m256 g = _mm256_loadu_ps(c + 8 * k), u = _mm256_loadu_ps(c + 16 + 8 * k), v;
        if (bg) g = _mm256_add_ps(g, _mm256_loadu_ps(bg + 8 * k));
        if (bu) u = _mm256_add_ps(u, _mm256_loadu_ps(bu + 8 * k));
        if (round) g = rbf8(g), u = rbf8(u);
        if (a->clamp) g = _mm256_min_ps(g, lim), u = _mm256_max_ps(_mm256_min_ps(u, lim), nlim);
        if (a->silu) {
            const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            v = _mm256_mul_ps(round ? rbf8(s) : s, u);
        } else {
            __m256 ga = _mm256_mul_ps(g, _mm256_set1_ps(a->alpha));
            if (round) ga = rbf8(ga);
            __m256 sg = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), ga))));
            if (round) sg = rbf8(sg);
            __m256 gs = _mm256_mul_ps(g, sg), uo = _mm256_add_ps(u, _mm256_set1_ps(a->up_offset));
            if (round) gs = rbf8(gs), uo = rbf8(uo);
            v = _mm256_mul_ps(gs, uo);
        }
        if (h_bf16) store_bf8((uint16_t *)h + 8 * k, v);
        else _mm256_storeu_ps((float *)h + 8 * k, round ? rbf8(v) : v);
    }
}

#ifdef HAVE_AVX512
AI512 __m512 rd16(__m512 v, int round) { return round ? rbf16x(v) : v; }

/* up_store_mx sixteen lanes at a time (the AVX-512 and BF16DOT kernels' epilogue) */
AI512 void up_store_mx16(const float *c, const float *bg, const float *bu, const mx_args *a, int round, void *h,
                         int h_bf16) {
    __m512 g = _mm512_loadu_ps(c), u = _mm512_loadu_ps(c + 16), v;
    if (bg) g = _mm512_add_ps(g, _mm512_loadu_ps(bg));
    if (bu) u = _mm512_add_ps(u, _mm512_loadu_ps(bu));
    g = rd16(g, round), u = rd16(u, round);
    if (a->clamp) {
        const __m512 lim = _mm512_set1_ps(a->limit);
        g = _mm512_min_ps(g, lim), u = _mm512_max_ps(_mm512_min_ps(u, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
    }
    const __m512 one = _mm512_set1_ps(1.0f);
    if (a->silu) {
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        v = _mm512_mul_ps(rd16(s, round), u);
    } else {
        const __m512 ga = rd16(_mm512_mul_ps(g, _mm512_set1_ps(a->alpha)), round);
        const __m512 sg = rd16(_mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), ga)))), round);
        v = _mm512_mul_ps(rd16(_mm512_mul_ps(g, sg), round), rd16(_mm512_add_ps(u, _mm512_set1_ps(a->up_offset)), round));
    }
    if (h_bf16) _mm256_storeu_si256((__m256i *)h, bf16_bits16(v));
    else _mm512_storeu_ps((float *)h, rd16(v, round));
}
#endif

/* The layout of one call: sizes, and per kernel the rows of its blocks. */
typedef struct {
    int64_t D, Dp, xpairs, kbx, Ik;   /* hidden size, even, in pairs, in AMX blocks of 16 pairs, AMX width */
    int64_t I16, hpairs, kbh, Hk, P2; /* h width, W2's input pairs, its AMX blocks and width; output panels */
    int64_t xb, hb;                   /* bytes of a gathered x row / an h row (the widest format in use) */
    int64_t xquads, hquads;           /* VNNI: quads of x's and h's codes (their scale and sum after) */
    int64_t up_rows[5], down_rows[5]; /* rows of an up / down block, per kernel */
    int round;                        /* bf16 x and y */
    codes_fmt f13, f2;                /* the code format of W13 (over D's pairs) and of W2 (over I's) */
    int64_t pb13, pb2;                /* bytes of a W13 / W2 panel's codes */
    int64_t up_off;                   /* bytes from a gate panel's codes to its up panel's */
    const mx_args *mx;                /* MXFP4 experts (NULL: int8 or FP8 codes) */
} layout;

static int tile_rows_max(int k) { return k == KERNEL_AVX2 ? MAX_R2 : k == KERNEL_AMX ? 32 : 8; }

/* VNNI's h rows: bf16 (bf16 x) or float32 values, quantised in place after the up GEMM */
static int64_t h_value_bytes(const layout *L) { return L->round ? 2 : 4; }

/* bytes of an x row / an h row in kernel k's format */
static int64_t x_bytes(const layout *L, int k) {
    if (k == KERNEL_VNNI) return 4 * L->xquads + 8; /* codes, then the row's scale and code sum */
    return k == KERNEL_AMX ? L->Ik * 2 : k == KERNEL_BF16DOT ? L->Dp * 2 : L->Dp * 4;
}
static int64_t h_bytes(const layout *L, int k) {
    return k == KERNEL_VNNI ? L->I16 * h_value_bytes(L)
           : k == KERNEL_AMX ? L->Hk * 2 : k == KERNEL_BF16DOT ? L->I16 * 2 : L->I16 * 4;
}

/* Rows of one block of kernel k reading rows of `bytes`: about X_BLOCK_BYTES, whole tiles. */
static int64_t block_rows(int k, int64_t bytes) {
    const int64_t m = tile_rows_max(k), b = X_BLOCK_BYTES / bytes / m * m;
#ifdef HAVE_BF16DOT
    if (k == KERNEL_BF16DOT && b > BF_ROWS) return BF_ROWS; /* panels_bf's buffer of sums */
#endif
#ifdef HAVE_VNNI
    if (k == KERNEL_VNNI && b > BF_ROWS) return BF_ROWS; /* panels_vn's, the same */
#endif
    return b < m ? m : b;
}

static dot_fn dot_of(int k, int fp8) {
#ifdef HAVE_AVX512
    if (k == KERNEL_AVX512) return fp8 ? dot_avx512_fp8 : dot_avx512;
#endif
    return fp8 ? dot_avx2_fp8 : dot_avx2;
}

/* Row r of the gathered x: token t's x in kernel k's format (float32 of Dp values, or bf16 of Dp or Ik
 * values), zero-padded; for AMX also the zero columns [I16, Hk) of its h row. */
static void gather_row(const layout *L, const void *x, int x_bf16, int64_t t, int k, char *xr, char *hr) {
    const int64_t D = L->D;
#ifdef HAVE_VNNI
    if (k == KERNEL_VNNI) {
        const void *row = x_bf16 ? (const void *)((const uint16_t *)x + t * D) : (const void *)((const float *)x + t * D);
        quant_row(row, x_bf16, D, 4 * L->xquads, (int8_t *)xr);
        return;
    }
#endif
    if (k == KERNEL_AVX2 || k == KERNEL_AVX512) {
        float *d = (float *)xr;
        if (x_bf16) {
            const uint16_t *s = (const uint16_t *)x + t * D;
            int64_t i = 0;
            for (; i + 8 <= D; i += 8) _mm256_storeu_ps(d + i, bf16x8_to_f32(s + i));
            for (; i < D; i++) d[i] = bf16_to_f32(s[i]);
        } else {
            memcpy(d, (const float *)x + t * D, 4 * (size_t)D);
        }
        if (L->Dp != D) d[D] = 0.0f;
        return;
    }
    const int64_t width = k == KERNEL_AMX ? L->Ik : L->Dp;
    memcpy(xr, (const uint16_t *)x + t * D, 2 * (size_t)D);
    memset(xr + 2 * D, 0, 2 * (size_t)(width - D));
    if (k == KERNEL_AMX) memset(hr + 2 * L->I16, 0, 2 * (size_t)(L->Hk - L->I16));
}

/* Up, one item with an FMA kernel: rows [r0, r1) of the gathered x times gate panel pg and up panel pu
 * (gs, us: their scales, panel_scales), h at column col. */
static void up_item(const layout *L, int k, const char *xs, int64_t r0, int64_t r1, const int8_t *pg, const int8_t *pu,
                    const float *gs, const float *us, char *hs, int64_t col, float *c) {
    const codes_fmt *f = &L->f13;
    const int max_r = tile_rows_max(k);
    const dot_fn dot = dot_of(k, f->fp8);
    const float *gso = f->fp8 ? ONES : gs, *uso = f->fp8 ? ONES : us;
    const int64_t ldx = L->xb / 4, tiles = (r1 - r0 + max_r - 1) / max_r;
    for (int64_t r = r0, ti = 0, n; r < r1; r += n, ti++) {
        n = (r1 - r + (tiles - ti) - 1) / (tiles - ti); /* even tiles: 17 rows -> 6, 6, 5 */
        dot(xs + r * L->xb, ldx, (int)n, pg, L->xpairs, f->fp8 ? gs : NULL, f->bpairs, c, 32);
        dot(xs + r * L->xb, ldx, (int)n, pu, L->xpairs, f->fp8 ? us : NULL, f->bpairs, c + 16, 32);
        for (int i = 0; i < n; i++) up_store(c + i * 32, gso, uso, L->round, hs + (r + i) * L->hb + col * 4, 0);
    }
}

/* Down, rows [r0, r1) of one expert over output panels [lo, hi) with an FMA kernel. */
static void down_rows(const layout *L, int k, const char *hs, int64_t r0, int64_t r1, const int8_t *w2, const float *s2,
                      int64_t lo, int64_t hi, const int64_t *tok, const float *wgt, char *y, float *c) {
    const codes_fmt *f = &L->f2;
    const int max_r = tile_rows_max(k), ysize = L->round ? 2 : 4;
    const dot_fn dot = dot_of(k, f->fp8);
    const int64_t ldh = L->hb / 4, tiles = (r1 - r0 + max_r - 1) / max_r;
    for (int64_t p = lo; p < hi; p++) {
        const int8_t *pw = w2 + p * L->hpairs * 32;
        const float *ps = panel_scales(f, s2, p), *os = out_scales(f, s2, p);
        const int nv = L->D - p * PANEL < PANEL ? (int)(L->D - p * PANEL) : PANEL;
        for (int64_t r = r0, ti = 0, n; r < r1; r += n, ti++) {
            n = (r1 - r + (tiles - ti) - 1) / (tiles - ti);
            dot(hs + r * L->hb, ldh, (int)n, pw, L->hpairs, f->fp8 ? ps : NULL, f->bpairs, c, 32);
            for (int i = 0; i < n; i++)
                down_store(c + i * 32, os, NULL, wgt[r + i], y + (tok[r + i] * L->D + p * PANEL) * ysize, nv, L->round);
        }
    }
}

/* The down phase's panel pairs (BF16DOT, VNNI): the codes to prefetch while panels p, p + 1 of [lo, hi)
 * run (the next pair, or after the last pair `after`, the thread's next call's first pair) and their
 * lines (pf_lines: 0 without). */
static inline const int8_t *down_next(const layout *L, const int8_t *w2, int64_t p, int64_t lo, int64_t hi,
                                      const int8_t *after, int64_t *pf_lines) {
    const int8_t *next = p + 2 < hi ? w2 + (p + 2) * L->pb2 : after;
    const int64_t panels = p + 2 < hi ? (hi - p - 2 < 2 ? hi - p - 2 : 2) : hi - lo < 2 ? hi - lo : 2;
    *pf_lines = next ? panels * L->pb2 / 64 : 0;
    return next;
}

/* The down epilogue of panels p (and p + 1 where two) for rows [r0, r1): each row's sums in cb (32 a
 * row, panel p's first) scaled, weighted and added into y (down_store16; BF16DOT, VNNI and AMX). */
#ifdef HAVE_AVX512
AI512 void down_pair_store(const layout *L, const float *cb, int64_t p, int two, int64_t r0, int64_t r1,
                           const float *s2, const float *b2, const int64_t *tok, const float *wgt, char *y) {
    const int ysize = L->round ? 2 : 4;
    for (int64_t q = p; q < p + 1 + two; q++) {
        const int nv = L->D - q * PANEL < PANEL ? (int)(L->D - q * PANEL) : PANEL;
        const float *scale = L->mx ? ONES : out_scales(&L->f2, s2, q), *bias = b2 ? b2 + q * PANEL : NULL;
        for (int64_t r = r0; r < r1; r++)
            down_store16(cb + (r - r0) * 32 + (q - p) * 16, scale, bias, wgt[r], y + (tok[r] * L->D + q * PANEL) * ysize,
                         nv, L->round);
    }
}
#endif

#ifdef HAVE_BF16DOT
/* Up, one item with BF16DOT: the gate and up panels side by side through panels_bf into cb (a row's 16
 * gate sums, then its 16 up sums), prefetching `next` (the codes of the thread's next item; NULL: none). */
TBF static void up_item_bf(const layout *L, const char *xs, int64_t r0, int64_t r1, const int8_t *pg, const int8_t *pu,
                           const float *gs, const float *us, char *hs, int64_t col, const int8_t *next, uint16_t *d,
                           float *cb) {
    const codes_fmt *f = &L->f13;
    panels_bf((const uint32_t *)(xs + r0 * L->xb), L->xb / 4, r1 - r0, pg, pu, L->xpairs, f, gs, us,
              (const char *)next, next ? L->xpairs : 0, d, cb, 32);
    const float *gso = f->fp8 ? ONES : gs, *uso = f->fp8 ? ONES : us;
    for (int64_t r = r0; r < r1; r++) up_store16(cb + (r - r0) * 32, gso, uso, L->round, hs + r * L->hb + col * 2, 1);
}

/* Down with BF16DOT, rows [r0, r1) of one expert over output panels [lo, hi): panels p and p + 1 side by
 * side through panels_bf (an odd last panel alone) into cb, prefetching the next pair's codes, or after
 * the last pair `after` (the thread's next call's first pair; NULL: none). */
TBF static void down_rows_bf(const layout *L, const char *hs, int64_t r0, int64_t r1, const int8_t *w2,
                             const float *s2, int64_t lo, int64_t hi, const int64_t *tok, const float *wgt, char *y,
                             const int8_t *after, uint16_t *d, float *cb) {
    const codes_fmt *f = &L->f2;
    const int64_t hp = L->hpairs;
    for (int64_t p = lo; p < hi; p += 2) {
        const int two = p + 1 < hi;
        const int8_t *pw = w2 + p * hp * 32;
        int64_t pf_lines;
        const int8_t *next = down_next(L, w2, p, lo, hi, after, &pf_lines);
        panels_bf((const uint32_t *)(hs + r0 * L->hb), L->hb / 4, r1 - r0, pw, two ? pw + hp * 32 : NULL, hp, f,
                  panel_scales(f, s2, p), two ? panel_scales(f, s2, p + 1) : NULL, (const char *)next, pf_lines, d,
                  cb, 32);
        down_pair_store(L, cb, p, two, r0, r1, s2, NULL, tok, wgt, y);
    }
}
#endif

#ifdef HAVE_VNNI
/* Up, one item with VNNI: the gate and up panels side by side through panels_vn into cb, then the
 * epilogue into h's values (bf16 for bf16 x, else float32), quantised once the up phase is done. */
TVN static void up_item_vn(const layout *L, const char *xs, int64_t r0, int64_t r1, const int8_t *pg, const int8_t *pu,
                           const float *gs, const float *us, char *hs, int64_t col, const int8_t *next, uint8_t *d,
                           float *cb) {
    panels_vn((const int8_t *)(xs + r0 * L->xb), L->xb, r1 - r0, pg, pu, L->xpairs, 4 * L->xquads, (const char *)next,
              next ? L->xpairs : 0, d, cb, 32);
    for (int64_t r = r0; r < r1; r++)
        up_store16(cb + (r - r0) * 32, gs, us, L->round, hs + r * L->hb + col * h_value_bytes(L), L->round);
}

/* Down with VNNI, rows [r0, r1) of one expert (h quantised) over output panels [lo, hi), two at a time,
 * prefetching as down_rows_bf does. */
TVN static void down_rows_vn(const layout *L, const char *hs, int64_t r0, int64_t r1, const int8_t *w2, const float *s2,
                             int64_t lo, int64_t hi, const int64_t *tok, const float *wgt, char *y,
                             const int8_t *after, uint8_t *d, float *cb) {
    const int64_t hp = L->hpairs;
    for (int64_t p = lo; p < hi; p += 2) {
        const int two = p + 1 < hi;
        const int8_t *pw = w2 + p * hp * 32;
        int64_t pf_lines;
        const int8_t *next = down_next(L, w2, p, lo, hi, after, &pf_lines);
        panels_vn((const int8_t *)(hs + r0 * L->hb), L->hb, r1 - r0, pw, two ? pw + hp * 32 : NULL, hp, 4 * L->hquads,
                  (const char *)next, pf_lines, d, cb, 32);
        down_pair_store(L, cb, p, two, r0, r1, s2, NULL, tok, wgt, y);
    }
}
#endif

#ifdef HAVE_AMX
/* Up, one item on AMX: both panels dequantised, then blocks of 32 rows (the gathered x has 32 spare
 * rows, so a partial block reads inside it; its extra rows are never stored). */
TAMX static void up_item_amx(const layout *L, const char *xs, int64_t r0, int64_t r1, const int8_t *pg,
                             const int8_t *pu, const float *gs, const float *us, char *hs, int64_t col, uint16_t *d0,
                             uint16_t *d1, float *c) {
    const codes_fmt *f = &L->f13;
    dequant_tiles(pg, L->xpairs, L->kbx, d0, f->fp8);
    dequant_tiles(pu, L->xpairs, L->kbx, d1, f->fp8);
    const float *gso = f->fp8 ? ONES : gs, *uso = f->fp8 ? ONES : us;
    for (int64_t r = r0; r < r1; r += AMX_ROWS) {
        const int n = r1 - r < AMX_ROWS ? (int)(r1 - r) : AMX_ROWS;
        const uint16_t *a = (const uint16_t *)(xs + r * L->xb);
        if (f->fp8) amx_block_fp8(a, L->xb, d0, d1, L->kbx, n > 16, c, f->bpairs / 16, gs, us);
        else amx_block(a, L->xb, d0, d1, L->kbx, n > 16, c);
        for (int i = 0; i < n; i++) up_store16(c + i * 32, gso, uso, L->round, hs + (r + i) * L->hb + col * 2, 1);
    }
}

/* Down on AMX: output panels two at a time. */
TAMX static void down_rows_amx(const layout *L, const char *hs, int64_t r0, int64_t r1, const int8_t *w2,
                               const float *s2, int64_t lo, int64_t hi, const int64_t *tok, const float *wgt, char *y,
                               uint16_t *d0, uint16_t *d1, float *c) {
    for (int64_t p = lo; p < hi; p += 2) {
        const int two_panels = p + 1 < hi;
        dequant_tiles(w2 + p * L->hpairs * 32, L->hpairs, L->kbh, d0, L->f2.fp8);
        if (two_panels) dequant_tiles(w2 + (p + 1) * L->hpairs * 32, L->hpairs, L->kbh, d1, L->f2.fp8);
        const float *bs0 = panel_scales(&L->f2, s2, p), *bs1 = two_panels ? panel_scales(&L->f2, s2, p + 1) : bs0;
        for (int64_t r = r0; r < r1; r += AMX_ROWS) {
            const int n = r1 - r < AMX_ROWS ? (int)(r1 - r) : AMX_ROWS;
            if (L->f2.fp8)
                amx_block_fp8((const uint16_t *)(hs + r * L->hb), L->hb, d0, two_panels ? d1 : d0, L->kbh, n > 16, c,
                              L->f2.bpairs / 16, bs0, bs1);
            else amx_block((const uint16_t *)(hs + r * L->hb), L->hb, d0, two_panels ? d1 : d0, L->kbh, n > 16, c);
            down_pair_store(L, c, p, two_panels, r, r + n, s2, NULL, tok, wgt, y);
        }
    }
}
#endif

/* MXFP4 experts with an FMA kernel: c rows (ldc floats apart) = R rows of float32 x (ldx apart) times the
 * G blocks of panel pw (scales ps), as mxfp4_linear's kernel of the same ISA sums them (mx_dot256 /
 * mx_dot512); and the epilogues of that ISA. */
typedef void (*mx_dot_fn)(const float *x, int64_t ldx, int R, const uint8_t *pw, const uint8_t *ps, int64_t G, float *c,
                          int64_t ldc);
typedef void (*mx_up_fn)(const float *c, const float *bg, const float *bu, const mx_args *a, int round, void *h,
                         int h_bf16);
typedef void (*mx_down_fn)(const float *c, const float *scale, const float *bias, float w, void *y, int nv, int round);

static inline __attribute__((always_inline)) void mx_dot256_c(const float *x, int64_t ldx, const int R,
                                                              const uint8_t *pw, const uint8_t *ps, int64_t G, float *c,
                                                              int64_t ldc) {
    __m256 sum[MAX_R2][2];
    mx_dot256(x, ldx, R, pw, ps, G, sum);
    for (int r = 0; r < R; r++) _mm256_storeu_ps(c + r * ldc, sum[r][0]), _mm256_storeu_ps(c + r * ldc + 8, sum[r][1]);
}
static void dot_mx256(const float *x, int64_t ldx, int R, const uint8_t *pw, const uint8_t *ps, int64_t G, float *c,
                      int64_t ldc) {
#define CALL(n) mx_dot256_c(x, ldx, n, pw, ps, G, c, ldc)
    BY_ROWS3(R, CALL)
#undef CALL
}
static void up_mx256(const float *c, const float *bg, const float *bu, const mx_args *a, int round, void *h, int h_bf16) {
    up_store_mx(c, bg, bu, a, round, h, h_bf16);
}
static void down_mx256(const float *c, const float *scale, const float *bias, float w, void *y, int nv, int round) {
    down_store(c, scale, bias, w, y, nv, round);
}

#ifdef HAVE_AVX512
AI512 void mx_dot512_c(const float *x, int64_t ldx, const int R, const uint8_t *pw, const uint8_t *ps, int64_t G,
                       float *c, int64_t ldc) {
    __m512 sum[MAX_R512];
    mx_dot512(x, ldx, R, pw, ps, G, sum);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(c + r * ldc, sum[r]);
}
T512 static void dot_mx512(const float *x, int64_t ldx, int R, const uint8_t *pw, const uint8_t *ps, int64_t G,
                           float *c, int64_t ldc) {
#define CALL(n) mx_dot512_c(x, ldx, n, pw, ps, G, c, ldc)
    BY_ROWS(R, CALL)
#undef CALL
}
T512 static void up_mx512(const float *c, const float *bg, const float *bu, const mx_args *a, int round, void *h,
                          int h_bf16) {
    up_store_mx16(c, bg, bu, a, round, h, h_bf16);
}
T512 static void down_mx512(const float *c, const float *scale, const float *bias, float w, void *y, int nv, int round) {
    down_store16(c, scale, bias, w, y, nv, round);
}
#endif

/* Up, one item of MXFP4 experts with FMA kernel k (AVX2 or AVX512): rows [r0, r1) of the gathered x
 * times gate panel pg and up panel pu (scales sg, su; biases bg, bu or NULL), h (float32 values) at
 * column col. */
static void up_item_mx(const layout *L, int k, const char *xs, int64_t r0, int64_t r1, const uint8_t *pg,
                       const uint8_t *pu, const uint8_t *sg, const uint8_t *su, const float *bg, const float *bu,
                       char *hs, int64_t col, float *c) {
    mx_dot_fn dot = dot_mx256;
    mx_up_fn up = up_mx256;
#ifdef HAVE_AVX512
    if (k == KERNEL_AVX512) dot = dot_mx512, up = up_mx512;
#endif
    const int max_r = tile_rows_max(k);
    const int64_t G = L->pb13 / MX_PANEL_BLOCK, tiles = (r1 - r0 + max_r - 1) / max_r;
    for (int64_t r = r0, ti = 0, n; r < r1; r += n, ti++) {
        n = (r1 - r + (tiles - ti) - 1) / (tiles - ti);
        dot((const float *)(xs + r * L->xb), L->xb / 4, (int)n, pg, sg, G, c, 32);
        dot((const float *)(xs + r * L->xb), L->xb / 4, (int)n, pu, su, G, c + 16, 32);
        for (int i = 0; i < n; i++) up(c + i * 32, bg, bu, L->mx, L->round, hs + (r + i) * L->hb + col * 4, 0);
    }
}

/* Down, rows [r0, r1) of one MXFP4 expert (W2's codes w2, scales s2, bias b2 or NULL) over output panels
 * [lo, hi) with FMA kernel k. */
static void down_rows_mx(const layout *L, int k, const char *hs, int64_t r0, int64_t r1, const uint8_t *w2,
                         const uint8_t *s2, const float *b2, int64_t lo, int64_t hi, const int64_t *tok,
                         const float *wgt, char *y, float *c) {
    mx_dot_fn dot = dot_mx256;
    mx_down_fn down = down_mx256;
#ifdef HAVE_AVX512
    if (k == KERNEL_AVX512) dot = dot_mx512, down = down_mx512;
#endif
    const int max_r = tile_rows_max(k), ysize = L->round ? 2 : 4;
    const int64_t G = L->pb2 / MX_PANEL_BLOCK, tiles = (r1 - r0 + max_r - 1) / max_r;
    for (int64_t p = lo; p < hi; p++)
        for (int64_t r = r0, ti = 0, n; r < r1; r += n, ti++) {
            n = (r1 - r + (tiles - ti) - 1) / (tiles - ti);
            dot((const float *)(hs + r * L->hb), L->hb / 4, (int)n, w2 + p * L->pb2, s2 + p * L->pb2 / 16, G, c, 32);
            for (int i = 0; i < n; i++)
                down(c + i * 32, ONES, b2 ? b2 + p * PANEL : NULL, wgt[r + i], y + (tok[r + i] * L->D + p * PANEL) * ysize,
                     PANEL, L->round);
        }
}

#ifdef HAVE_BF16DOT
/* Up, one item of MXFP4 experts with BF16DOT: the gate and up panels decoded side by side and dotted
 * (panels_mx) into cb, prefetching the next item's gate panel (`next`; NULL: none), then the epilogue. */
TBF static void up_item_mx_bf(const layout *L, const char *xs, int64_t r0, int64_t r1, const uint8_t *pg,
                              const uint8_t *pu, const uint8_t *sg, const uint8_t *su, const float *bg, const float *bu,
                              char *hs, int64_t col, const int8_t *next, uint16_t *d, float *cb) {
    panels_mx((const uint32_t *)(xs + r0 * L->xb), L->xb / 4, r1 - r0, pg, sg, pu, su, L->pb13 / MX_PANEL_BLOCK, d,
              (const char *)next, next ? L->pb13 / 64 : 0, cb, 32);
    for (int64_t r = r0; r < r1; r++)
        up_store_mx16(cb + (r - r0) * 32, bg, bu, L->mx, L->round, hs + r * L->hb + col * 2, 1);
}

/* Down with BF16DOT, rows [r0, r1) of one MXFP4 expert over output panels [lo, hi), two at a time,
 * prefetching as down_rows_bf does. */
TBF static void down_rows_mx_bf(const layout *L, const char *hs, int64_t r0, int64_t r1, const uint8_t *w2,
                                const uint8_t *s2, const float *b2, int64_t lo, int64_t hi, const int64_t *tok,
                                const float *wgt, char *y, const int8_t *after, uint16_t *d, float *cb) {
    for (int64_t p = lo; p < hi; p += 2) {
        const int two = p + 1 < hi;
        const uint8_t *pw = w2 + p * L->pb2, *ps = s2 + p * L->pb2 / 16;
        int64_t pf_lines;
        const int8_t *next = down_next(L, (const int8_t *)w2, p, lo, hi, after, &pf_lines);
        panels_mx((const uint32_t *)(hs + r0 * L->hb), L->hb / 4, r1 - r0, pw, ps, two ? pw + L->pb2 : NULL,
                  ps + L->pb2 / 16, L->pb2 / MX_PANEL_BLOCK, d, (const char *)next, pf_lines, cb, 32);
        down_pair_store(L, cb, p, two, r0, r1, NULL, b2, tok, wgt, y);
    }
}
#endif

/* An MXFP4 expert's float32 bias of W13 or W2 (b: every expert's address, 0 none; NULL: none at all) */
static inline const float *mx_bias(const int64_t *b, int64_t e) {
    return b && b[e] ? (const float *)(uintptr_t)b[e] : NULL;
}

/* The codes of up item `it`: its gate panel (its up panel L->up_off bytes on). */
static inline const int8_t *up_codes(const layout *L, const int64_t *w13, const int64_t *items, int64_t it) {
    return (const int8_t *)(uintptr_t)w13[items[3 * it]] + (L->mx ? 1 : 2) * items[3 * it + 2] * L->pb13;
}

/* The codes the down phase reads after expert e's rows up to r1 (count: the experts' first rows) over
 * output panels from lo: the same expert's next block of rows, else the next expert with rows; NULL
 * at the end. */
static const int8_t *down_after(const layout *L, const int64_t *w2, const int64_t *count, int64_t E, int64_t e,
                                int64_t r1, int64_t lo) {
    if (r1 < count[e + 1]) return (const int8_t *)(uintptr_t)w2[e] + lo * L->pb2;
    for (e++; e < E; e++)
        if (count[e + 1] > count[e]) return (const int8_t *)(uintptr_t)w2[e] + lo * L->pb2;
    return NULL;
}

/* Whether kernel k can run this call (built, bf16 x for BF16DOT / AMX, AMX's tiles granted). */
static int kernel_runs(int k, int x_bf16) {
    if (k < KERNEL_AVX2 || k > KERNEL_VNNI || !(shuttle_int8_kernels() >> k & 1)) return 0;
    if ((k == KERNEL_BF16DOT || k == KERNEL_AMX) && !x_bf16) return 0;
    return k != KERNEL_AMX || shuttle_int8_amx_ready();
}

/* The fused block on panels of formats f13 (W13) and f2 (W2); the arguments as shuttle_fused_moe_int8's. */
static int moe_panels(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk, int64_t K,
                      const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2, int64_t E, int64_t I,
                      const codes_fmt *f13, const codes_fmt *f2, void *y, int nthreads, int kernel, int big_kernel,
                      int64_t big_rows, int64_t vnni_rows, const mx_args *mx) {
    if (!kernel_runs(kernel, x_bf16) || !kernel_runs(big_kernel, x_bf16)) return -2;
    if (mx && (kernel > KERNEL_AVX512 || big_kernel > KERNEL_BF16DOT || vnni_rows > 0 || D % MX_BLOCK || I % MX_BLOCK))
        return -2; /* MXFP4: an FMA kernel, or BF16DOT from big_rows on */
    if (vnni_rows > 0 && !kernel_runs(KERNEL_VNNI, x_bf16)) return -2;
    if ((kernel == KERNEL_VNNI || big_kernel == KERNEL_VNNI || vnni_rows > 0) &&
        (f13->fp8 || f2->fp8 || D > VN_MAX_K || I > VN_MAX_K))
        return -2; /* VNNI: int8 codes, sums inside int32 */
    const int64_t N = T * K;
    if (N <= 0 || D <= 0 || I <= 0 || E <= 0) return 0;
    layout L = {.D = D, .Dp = D + (D & 1), .I16 = (I + 15) / 16 * 16, .hpairs = (I + 1) / 2,
                .P2 = (D + PANEL - 1) / PANEL, .round = x_bf16, .f13 = *f13, .f2 = *f2};
    L.xpairs = L.Dp / 2, L.kbx = (L.xpairs + 15) / 16, L.Ik = L.kbx * 32;
    L.kbh = (L.hpairs + 15) / 16, L.Hk = L.kbh * 32;
    L.xquads = (L.xpairs + 1) / 2, L.hquads = (L.hpairs + 1) / 2;
    const int64_t U = L.I16 / 16; /* panel pairs of W13 */
    L.pb13 = (mx ? 16 : 32) * L.xpairs, L.pb2 = (mx ? 16 : 32) * L.hpairs, L.mx = mx;
    L.up_off = mx ? U * L.pb13 : L.pb13; /* (MXFP4: W13's gate rows, then its up rows) */
    int64_t *count = calloc(E + 1, sizeof(int64_t)), *tok = malloc(sizeof(int64_t) * (N + 1)), *items = NULL;
    float *wgt = malloc(sizeof(float) * (N + 1));
    int8_t *kern = malloc(E + 1);
    char *xs = NULL, *hs = NULL;
    uint16_t *dq = NULL;
    float *sums = NULL; /* BF16DOT: each thread's BF_ROWS x 32 sums (panels_bf) */
    if (!count || !tok || !wgt || !kern) goto fail;
    for (int64_t n = 0; n < N; n++)
        if (ids[n] >= 0 && ids[n] < E) count[ids[n] + 1]++;
    int uses[5] = {0};
    for (int64_t e = 0; e < E; e++) {
        kern[e] = (int8_t)(vnni_rows > 0 && count[e + 1] >= vnni_rows ? KERNEL_VNNI
                           : count[e + 1] >= big_rows                  ? big_kernel
                                                                       : kernel);
        if (count[e + 1]) uses[kern[e]] = 1;
    }
    L.xb = L.hb = 64;
    for (int k = 0; k < 5; k++)
        if (uses[k]) {
            if (x_bytes(&L, k) > L.xb) L.xb = x_bytes(&L, k);
            if (h_bytes(&L, k) > L.hb) L.hb = h_bytes(&L, k);
        }
    L.xb = (L.xb + 63) / 64 * 64, L.hb = (L.hb + 63) / 64 * 64;
    for (int k = 0; k < 5; k++) L.up_rows[k] = block_rows(k, x_bytes(&L, k));
    for (int k = 0; k < 5; k++) L.down_rows[k] = block_rows(k, h_bytes(&L, k));
    int64_t nitems = 0;
    for (int64_t e = 0; e < E; e++) {
        nitems += (count[e + 1] + L.up_rows[kern[e]] - 1) / L.up_rows[kern[e]] * U;
        count[e + 1] += count[e]; /* count[e]: expert e's first row */
    }
    const int64_t rows = count[E]; /* the pairs not skipped */
    items = malloc(sizeof(int64_t) * 3 * (nitems + 1));
    if (!items) goto fail;
    {
        int64_t *fill = malloc(sizeof(int64_t) * (E + 1)), it = 0;
        if (!fill) goto fail;
        memcpy(fill, count, sizeof(int64_t) * (size_t)E);
        for (int64_t n = 0; n < N; n++) /* stable: pairs of one expert keep token order */
            if (ids[n] >= 0 && ids[n] < E) {
                const int64_t i = fill[ids[n]]++;
                tok[i] = n / K;
                wgt[i] = wk[n];
            }
        free(fill);
        for (int64_t e = 0; e < E; e++) {
            const int64_t block = L.up_rows[kern[e]];
            for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += block)
                for (int64_t u = 0; u < U; u++, it++) items[3 * it] = e, items[3 * it + 1] = r0, items[3 * it + 2] = u;
        }
    }
    /* under passive waits a second thread must be worth its wake-up (as shuttle_int8_linear) */
    if (passive_waits() && rows * 3 * I * D < (1 << 23)) nthreads = 1;
    if (nthreads > (nitems > L.P2 ? nitems : L.P2)) nthreads = (int)(nitems > L.P2 ? nitems : L.P2);
    if (nthreads < 1) nthreads = 1;
    /* 32 spare rows (zeros) after the last, where an AMX block may read */
    xs = aligned_alloc(64, (size_t)((rows + 32) * L.xb)), hs = aligned_alloc(64, (size_t)((rows + 32) * L.hb));
    const size_t panel_bytes = (size_t)(L.kbx > L.kbh ? L.kbx : L.kbh) * 1024; /* one panel in bf16, padded */
    const int copies = uses[KERNEL_BF16DOT] || uses[KERNEL_AMX] || uses[KERNEL_VNNI]; /* (VNNI: fits) */
    if (copies) dq = aligned_alloc(64, 2 * panel_bytes * (size_t)nthreads);
#ifdef HAVE_BF16DOT
    if ((uses[KERNEL_BF16DOT] || uses[KERNEL_VNNI]) &&
        !(sums = aligned_alloc(64, sizeof(float) * BF_ROWS * 32 * (size_t)nthreads)))
        goto fail;
#endif
    if (!xs || !hs || (copies && !dq)) goto fail;
    memset(xs + rows * L.xb, 0, (size_t)(32 * L.xb));
    memset(hs + rows * L.hb, 0, (size_t)(32 * L.hb));
    int64_t taken = 0, gathered = 0, arrived = 0, quantised = 0; /* the up items' chunks handed out; barriers */
    #pragma omp parallel num_threads(nthreads)
    {
        float c[C_ROWS * 32] __attribute__((aligned(64)));
        float *cb = sums ? sums + BF_ROWS * 32 * (size_t)omp_get_thread_num() : NULL;
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t *d0 = dq ? (uint16_t *)((char *)dq + 2 * panel_bytes * (size_t)th) : NULL;
        uint16_t *d1 = dq ? (uint16_t *)((char *)d0 + panel_bytes) : NULL;
        int amx_on = 0;
        /* gather: this thread's share of the sorted rows */
        {
            int64_t r = rows * th / nt, e = 0;
            const int64_t r_hi = rows * (th + 1) / nt;
            for (; r < r_hi; r++) {
                while (count[e + 1] <= r) e++;
                gather_row(&L, x, x_bf16, tok[r], kern[e], xs + r * L.xb, hs + r * L.hb);
            }
        }
        if (nt > 1) spin_barrier(&gathered, nt);
        /* up: chunks of UP_CHUNK items, claimed as threads get to them; a thread claims its next chunk
         * as it starts one, so that the dots of each item know the item after it (to prefetch) */
        for (int64_t it0 = UP_CHUNK * __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED), nx0; it0 < nitems; it0 = nx0) {
            nx0 = UP_CHUNK * __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED);
            for (int64_t it = it0; it < it0 + UP_CHUNK && it < nitems; it++) {
                const int64_t e = items[3 * it], r0 = items[3 * it + 1], u = items[3 * it + 2];
                const int k = kern[e];
                const int64_t r1 = count[e + 1] - r0 < L.up_rows[k] ? count[e + 1] : r0 + L.up_rows[k];
                const int8_t *pg = up_codes(&L, w13, items, it), *pu = pg + L.up_off;
                if (mx) {
                    const uint8_t *sg = (const uint8_t *)(uintptr_t)s13[e] + u * L.pb13 / 16, *su = sg + L.up_off / 16;
                    const float *b = mx_bias(mx->b13, e), *bg = b ? b + 16 * u : NULL, *bu = b ? b + I + 16 * u : NULL;
#ifdef HAVE_BF16DOT
                    if (k == KERNEL_BF16DOT) {
                        const int64_t nx = it + 1 < it0 + UP_CHUNK && it + 1 < nitems ? it + 1 : nx0;
                        const int8_t *next = nx < nitems ? up_codes(&L, w13, items, nx) : NULL;
                        up_item_mx_bf(&L, xs, r0, r1, (const uint8_t *)pg, (const uint8_t *)pu, sg, su, bg, bu, hs,
                                      16 * u, next, d0, cb);
                        continue;
                    }
#endif
                    up_item_mx(&L, k, xs, r0, r1, (const uint8_t *)pg, (const uint8_t *)pu, sg, su, bg, bu, hs, 16 * u, c);
                    continue;
                }
                const float *gs = panel_scales(&L.f13, (const float *)(uintptr_t)s13[e], 2 * u);
                const float *us = panel_scales(&L.f13, (const float *)(uintptr_t)s13[e], 2 * u + 1);
#ifdef HAVE_VNNI
                if (k == KERNEL_VNNI) {
                    const int64_t nx = it + 1 < it0 + UP_CHUNK && it + 1 < nitems ? it + 1 : nx0;
                    const int8_t *next = nx < nitems ? up_codes(&L, w13, items, nx) : NULL;
                    up_item_vn(&L, xs, r0, r1, pg, pu, gs, us, hs, 16 * u, next, (uint8_t *)d0, cb);
                    continue;
                }
#endif
#ifdef HAVE_AMX
                if (k == KERNEL_AMX) {
                    if (!amx_on) amx_begin(), amx_on = 1;
                    up_item_amx(&L, xs, r0, r1, pg, pu, gs, us, hs, 16 * u, d0, d1, c);
                    continue;
                }
#endif
#ifdef HAVE_BF16DOT
                if (k == KERNEL_BF16DOT) {
                    const int64_t nx = it + 1 < it0 + UP_CHUNK && it + 1 < nitems ? it + 1 : nx0;
                    const int8_t *next = nx < nitems ? up_codes(&L, w13, items, nx) : NULL;
                    up_item_bf(&L, xs, r0, r1, pg, pu, gs, us, hs, 16 * u, next, d0, cb);
                    continue;
                }
#endif
                up_item(&L, k, xs, r0, r1, pg, pu, gs, us, hs, 16 * u, c);
            }
        }
        if (nt > 1) spin_barrier(&arrived, nt);
#ifdef HAVE_VNNI
        if (uses[KERNEL_VNNI]) { /* VNNI's h rows quantised in place: this thread's share of the rows */
            int64_t r = rows * th / nt, e = 0;
            const int64_t r_hi = rows * (th + 1) / nt;
            for (; r < r_hi; r++) {
                while (count[e + 1] <= r) e++;
                if (kern[e] == KERNEL_VNNI)
                    quant_row(hs + r * L.hb, L.round, 4 * L.hquads, 4 * L.hquads, (int8_t *)(hs + r * L.hb));
            }
            if (nt > 1) spin_barrier(&quantised, nt);
        }
#endif
        /* down: output panels [lo, hi), every expert in ascending id, blocks of its rows */
        const int64_t pairs2 = (L.P2 + 1) / 2, lo = 2 * (pairs2 * th / nt), hi_2 = 2 * (pairs2 * (th + 1) / nt);
        const int64_t hi = hi_2 < L.P2 ? hi_2 : L.P2; /* whole pairs of panels (BF16DOT dots two at once) */
        for (int64_t e = 0; e < E && lo < hi; e++) {
            const int k = kern[e];
            const int64_t block = L.down_rows[k];
            const int8_t *pw = (const int8_t *)(uintptr_t)w2[e];
            const float *ps = (const float *)(uintptr_t)s2[e];
            for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += block) {
                const int64_t r1 = count[e + 1] - r0 < block ? count[e + 1] : r0 + block;
                if (mx) {
                    const float *b2e = mx_bias(mx->b2, e);
#ifdef HAVE_BF16DOT
                    if (k == KERNEL_BF16DOT) {
                        const int8_t *after = down_after(&L, w2, count, E, e, r1, lo);
                        down_rows_mx_bf(&L, hs, r0, r1, (const uint8_t *)pw, (const uint8_t *)ps, b2e, lo, hi, tok, wgt,
                                        (char *)y, after, d0, cb);
                        continue;
                    }
#endif
                    down_rows_mx(&L, k, hs, r0, r1, (const uint8_t *)pw, (const uint8_t *)ps, b2e, lo, hi, tok, wgt,
                                 (char *)y, c);
                    continue;
                }
#ifdef HAVE_VNNI
                if (k == KERNEL_VNNI) {
                    const int8_t *after = down_after(&L, w2, count, E, e, r1, lo);
                    down_rows_vn(&L, hs, r0, r1, pw, ps, lo, hi, tok, wgt, (char *)y, after, (uint8_t *)d0, cb);
                    continue;
                }
#endif
#ifdef HAVE_AMX
                if (k == KERNEL_AMX) {
                    if (!amx_on) amx_begin(), amx_on = 1;
                    down_rows_amx(&L, hs, r0, r1, pw, ps, lo, hi, tok, wgt, (char *)y, d0, d1, c);
                    continue;
                }
#endif
#ifdef HAVE_BF16DOT
                if (k == KERNEL_BF16DOT) {
                    const int8_t *after = down_after(&L, w2, count, E, e, r1, lo);
                    down_rows_bf(&L, hs, r0, r1, pw, ps, lo, hi, tok, wgt, (char *)y, after, d0, cb);
                    continue;
                }
#endif
                down_rows(&L, k, hs, r0, r1, pw, ps, lo, hi, tok, wgt, (char *)y, c);
            }
        }
#ifdef HAVE_AMX
        if (amx_on) amx_end();
#endif
    }
    free(items), free(count), free(tok), free(wgt), free(kern), free(xs), free(hs), free(dq), free(sums);
    return 0;
fail:
    free(items), free(count), free(tok), free(wgt), free(kern), free(xs), free(hs), free(dq), free(sums);
    return -1;
}

/* x (T, D) float32 or bf16 (x_bf16), contiguous; ids (T, K) int64; wk (T, K) float32; per expert e:
 * w13[e] / s13[e] the codes and scales of its gate/up panels (2 * ceil(I / 16) panels of 16 outputs
 * over ceil(D / 2) pairs: panel 2u the gate rows 16u..16u+15, panel 2u + 1 the same up rows, rows
 * past I zero), w2[e] / s2[e] those of its down projection (ceil(D / 16) panels over ceil(I / 2)
 * pairs), as addresses; y (T, D) in x's dtype, zeroed. An expert with at least vnni_rows rows (> 0;
 * 0: none) runs VNNI on per-row int8 activations (w8a8's arithmetic on the same codes), else one with
 * at least big_rows rows big_kernel, the others `kernel` (KERNEL_*: AVX2, AVX512, or for bf16 x
 * BF16DOT, AMX after shuttle_int8_amx_init, or VNNI). Returns 0; -1 if memory ran out (y is then
 * unchanged); -2 for a kernel this build or call cannot run. */
int shuttle_fused_moe_int8(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                           int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                           int64_t E, int64_t I, void *y, int nthreads, int kernel, int big_kernel, int64_t big_rows,
                           int64_t vnni_rows) {
    const codes_fmt f = {0, 0, 0};
    return moe_panels(x, x_bf16, T, D, ids, wk, K, w13, s13, w2, s2, E, I, &f, &f, y, nthreads, kernel, big_kernel,
                      big_rows, vnni_rows, NULL);
}

/* shuttle_fused_moe_int8 on FP8 E4M3 experts (kernels/fp8_weights.py: Fp8Experts): s13[e] / s2[e] the
 * addresses of each panel's block scales (fp8_linear's layout: W13's blocks of bpairs13 pairs of x,
 * W2's of bpairs2 pairs of h). The AVX2 kernel needs F16C. */
int shuttle_fused_moe_fp8(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                          int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                          int64_t E, int64_t I, int64_t bpairs13, int64_t bpairs2, void *y, int nthreads, int kernel,
                          int big_kernel, int64_t big_rows) {
    if (bpairs13 < 1 || bpairs2 < 1) return -2;
    if ((kernel == KERNEL_AMX || big_kernel == KERNEL_AMX) && (bpairs13 % 16 || bpairs2 % 16))
        return -2; /* AMX: blocks of whole k-steps */
    const int64_t xpairs = (D + 1) / 2, hpairs = (I + 1) / 2;
    /* BF16DOT folds an expert's block of rows by its rows (the blocks do not depend on the threads) */
    const codes_fmt f13 = {1, bpairs13, (xpairs + bpairs13 - 1) / bpairs13, FOLD_ROWS};
    const codes_fmt f2 = {1, bpairs2, (hpairs + bpairs2 - 1) / bpairs2, FOLD_ROWS};
    return moe_panels(x, x_bf16, T, D, ids, wk, K, w13, s13, w2, s2, E, I, &f13, &f2, y, nthreads, kernel, big_kernel,
                      big_rows, 0, NULL);
}

/* The block on MXFP4 experts (kernels/mxfp4_weights.py: fused_moe_mxfp4, Mxfp4Experts), x and y in float32
 * or bfloat16:
 *     y[t] = sum over t's top-k experts e of w[t,k] * (act(x[t] W1_e^T + b1_e, x[t] W3_e^T + b3_e) W2_e^T + b2_e)
 * with act the SwiGLU of kernels/moe.py (silu(gate) * up; gpt-oss's gate * sigmoid(alpha gate) * (up + 1)
 * with both clamped at `limit`), the weights' biases optional: kernels/moe.py's fused_moe_packed on
 * per-expert Mxfp4Weight linears (mxfp4_linear's kernels: the same products, float32 sums in an order
 * that can differ with the tiling of the rows), rounded where that rounds for bf16 x (each linear's output, every op of the activation, each weighted
 * output, every partial sum of a token's outputs added in ascending expert id as unpermute's index_add_
 * adds), in moe_panels' one parallel region. x (T, D), ids and wk (T, K) (ids int64, weights float32);
 * w13[e], s13[e], w2[e], s2[e]: expert e's panels and scales (Mxfp4Weight: w13 (2I, D), w2 (D, I)); b13,
 * b2: NULL or each expert's float32 bias (2I) / (D) (an entry 0: none); y (T, D) in x's dtype, written
 * whole. kernel: AVX2 or AVX512 (the FMA kernels); bf16dot_rows: per row bucket (kernels/native.bucket),
 * 1 where bf16 x takes BF16DOT instead (kernels/choice.py's "mxfp4" table; NULL: never): an expert takes
 * it from the first bucket of the table's last run of ones. Returns 0; -1 out of memory; -2 for a kernel
 * this build lacks, or D or I not a multiple of 32. */
int shuttle_fused_moe_mxfp4(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                            int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                            const int64_t *b13, const int64_t *b2, int64_t E, int64_t I, float alpha, float limit,
                            float up_offset, void *y, int nthreads, int kernel, const uint8_t *bf16dot_rows) {
    int64_t big_rows = INT64_MAX;
    for (int b = BUCKETS - 1; b >= 0 && x_bf16 && bf16dot_rows && bf16dot_rows[b]; b--)
        big_rows = b ? ((int64_t)1 << (b - 1)) + 1 : 1; /* the fewest rows of bucket b */
    const int clamp = isfinite(limit);
    const mx_args a = {b13, b2, alpha, clamp && x_bf16 ? rbf(limit) : limit, up_offset,
                       alpha == 1.0f && up_offset == 0.0f, clamp};
    const codes_fmt f = {0, 0, 0};
    memset(y, 0, (size_t)(T * D) * (x_bf16 ? 2 : 4));
    return moe_panels(x, x_bf16, T, D, ids, wk, K, w13, s13, w2, s2, E, I, &f, &f, y, nthreads, kernel,
                      big_rows < INT64_MAX ? KERNEL_BF16DOT : kernel, big_rows, 0, &a);
}
