/* The whole MoE block of one layer in one call on MXFP4 experts (kernels/mxfp4_weights.py: fused_moe_mxfp4),
 * x and y in float32 or bfloat16:
 *     y[t] = sum over t's top-k experts e of w[t,k] * (act(x[t] W1_e^T + b1_e, x[t] W3_e^T + b3_e) W2_e^T + b2_e)
 * with act the SwiGLU of kernels/moe.py (silu(gate) * up; gpt-oss's gate * sigmoid(alpha gate) * (up + 1)
 * with both clamped at `limit`), the weights' biases optional. It is kernels/moe.py's fused_moe_packed on
 * per-expert Mxfp4Weight linears, in the same order and rounded where that rounds for bf16 x (each linear's
 * output, every op of the activation, each weighted output, every partial sum of a token's outputs added
 * in ascending expert id as unpermute's index_add_ adds), without its ~12 torch ops and two Python
 * linear calls per active expert:
 *  1. a counting sort of the T*K (token, expert) pairs by expert (stable); ids outside [0, E) skipped;
 *  2. per expert with rows: its x rows gathered, shuttle_mxfp4_linear for gate/up (W13 (2I, D): the gate
 *     rows then the up rows, as the checkpoint stores them), the activation, shuttle_mxfp4_linear for
 *     down, and the weighted rows added into y. The linears run their own threads; the kernel per expert
 *     is the measured one for its row count (`bf16dot_rows`: kernels/choice.py's "mxfp4" table per
 *     row bucket of kernels/native.bucket, for bf16 x; else `kernel`).
 * Where `kernel` is AVX512 (the CPU has AVX-512) the call goes to moe_int8.c's block instead
 * (shuttle_moe_panels_mxfp4): the same kernels, sums and roundings, so the same bits, in one parallel
 * region (threads claim gate/up panel pairs across experts, the activation in their epilogue, then own
 * output columns across experts, the weighted add in theirs) rather than two per expert, and BF16DOT
 * from the table's last run of bf16dot buckets on. 256 tokens of 8 x 1024 x 2048 top-2 experts took
 * 1.24x the bf16 block's time this way and 1.04-1.09x in one region with the decode in the first tile
 * (Zen 5 EPYC). */
#include "bf16_avx2.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MX_BUCKETS 12 /* kernels/native.BUCKET_ROWS */
#define MX_AVX512 1   /* kernels/int8.py's AVX512 */
#define MX_BF16DOT 2  /* kernels/int8.py's BF16DOT */

int shuttle_mxfp4_linear(const void *x, int x_bf16, int64_t T, int64_t I, const uint8_t *panels,
                         const uint8_t *scales, const float *bias, int64_t O, void *y, int y_bf16, int nthreads,
                         int kernel);
int shuttle_moe_panels_mxfp4(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                             int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                             const int64_t *b13, const int64_t *b2, int64_t E, int64_t I, float alpha, float limit,
                             float up_offset, void *y, int nthreads, int big_kernel, int64_t big_rows);

static int mx_bucket(int64_t rows) { /* kernels/native.bucket: bit_length(rows - 1), the last open-ended */
    int b = 0;
    for (int64_t r = rows - 1; r > 0; r >>= 1) b++;
    return b < MX_BUCKETS - 1 ? b : MX_BUCKETS - 1;
}

#define PAR_MIN 32768 /* values of an activation or a combine from which its loop takes every thread */

static inline __m256 ld8(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x8_to_f32((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline void st8(void *p, int64_t i, __m256 v, int bf16) { /* bf16: rounded to nearest even */
    if (bf16) store_bf8((uint16_t *)p + i, v);
    else _mm256_storeu_ps((float *)p + i, v);
}

/* v rounded as the dtype's torch op result is: bf16 to nearest even, float32 as is */
static inline __m256 rd8(__m256 v, int bf16) { return bf16 ? rbf8(v) : v; }

static inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* h (n, I) = act(gate, up) of gu (n, 2I), each op rounded as kernels/moe.SwiGLU's torch ops round (I a
 * multiple of 8: MXFP4 inputs come in blocks of 32) */
static void activation(const void *gu, void *h, int64_t n, int64_t I, int bf16, float alpha, float limit,
                       float up_offset, int nthreads) {
    const int silu = alpha == 1.0f && up_offset == 0.0f; /* SwiGLU.is_clamped_silu (or plain SiLU) */
    const int clamp = isfinite(limit);
    if (clamp && bf16) limit = rbf(limit); /* (a bf16 tensor's clamp gives bf16 values: the limit's) */
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit), al = _mm256_set1_ps(alpha);
    const __m256 off = _mm256_set1_ps(up_offset);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n * I >= PAR_MIN)
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < I; i += 8) {
            __m256 g = ld8(gu, r * 2 * I + i, bf16), u = ld8(gu, r * 2 * I + I + i, bf16);
            if (clamp) g = _mm256_min_ps(g, lim), u = _mm256_max_ps(_mm256_min_ps(u, lim), nlim);
            __m256 a;
            if (silu) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)); /* silu = g / (1 + e^-g), as torch */
                a = _mm256_mul_ps(rd8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), bf16), u);
            } else {
                const __m256 sg = rd8(sigmoid8(rd8(_mm256_mul_ps(g, al), bf16)), bf16);
                a = _mm256_mul_ps(rd8(_mm256_mul_ps(g, sg), bf16), rd8(_mm256_add_ps(u, off), bf16));
            }
            st8(h, r * I + i, a, bf16);
        }
}

/* y[tok[r]] += (ye[r] w[r]) for an expert's n rows, each in x's dtype (unpermute: the weighted row rounded,
 * then each sum), the rows in order; threads split the D columns (D a multiple of 8). */
static void combine(const void *ye, const int64_t *order, const float *wk, int64_t K, int64_t n, int64_t D, void *y,
                    int bf16, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n * D >= PAR_MIN)
    for (int64_t d0 = 0; d0 < D; d0 += 64)
        for (int64_t r = 0; r < n; r++) {
            const int64_t t = order[r] / K;
            const __m256 w = _mm256_set1_ps(wk[order[r]]);
            for (int64_t d = d0; d < d0 + 64 && d < D; d += 8) {
                const __m256 v = rd8(_mm256_mul_ps(ld8(ye, r * D + d, bf16), w), bf16);
                st8(y, t * D + d, _mm256_add_ps(ld8(y, t * D + d, bf16), v), bf16);
            }
        }
}

/* x (T, D), ids and wk (T, K) (ids int64, weights float32); w13[e], s13[e], w2[e], s2[e]: expert e's
 * panels and scales (Mxfp4Weight: w13 (2I, D), w2 (D, I)); b13, b2: NULL or each expert's float32 bias
 * (2I) / (D) (an entry 0: none); y (T, D) in x's dtype, written whole. kernel: AVX2 or AVX512 (the FMA
 * kernels), bf16dot_rows: per row bucket, 1 where bf16 x takes BF16DOT instead (NULL: never). Returns
 * 0; -1 out of memory; the linears' error otherwise (-2: a kernel this build lacks). */
int shuttle_fused_moe_mxfp4(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                            int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                            const int64_t *b13, const int64_t *b2, int64_t E, int64_t I, float alpha, float limit,
                            float up_offset, void *y, int nthreads, int kernel, const uint8_t *bf16dot_rows) {
    const size_t xs = x_bf16 ? 2 : 4;
    const int64_t N = T * K;
    if (D % 8 || I % 8) return -2; /* (MXFP4 weights take inputs in blocks of 32) */
    if (kernel == MX_AVX512) { /* moe_int8.c's one parallel region; BF16DOT from the table's last run of it on */
        int64_t big_rows = INT64_MAX;
        for (int b = MX_BUCKETS - 1; b >= 0 && x_bf16 && bf16dot_rows && bf16dot_rows[b]; b--)
            big_rows = b ? ((int64_t)1 << (b - 1)) + 1 : 1; /* the fewest rows of bucket b */
        const int rc = shuttle_moe_panels_mxfp4(x, x_bf16, T, D, ids, wk, K, w13, s13, w2, s2, b13, b2, E, I, alpha,
                                                limit, up_offset, y, nthreads,
                                                big_rows < INT64_MAX ? MX_BF16DOT : MX_AVX512, big_rows);
        if (rc != -2) return rc;
    }
    memset(y, 0, (size_t)(T * D) * xs);
    int64_t *count = calloc((size_t)E + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)(N ? N : 1));
    if (!count || !order) {
        free(count), free(order);
        return -1;
    }
    for (int64_t p = 0; p < N; p++)
        if (ids[p] >= 0 && ids[p] < E) count[ids[p] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < E; e++) {
        most = count[e + 1] > most ? count[e + 1] : most;
        count[e + 1] += count[e];
    }
    {
        int64_t *next = malloc(sizeof(int64_t) * (size_t)(E ? E : 1));
        if (!next) {
            free(count), free(order);
            return -1;
        }
        memcpy(next, count, sizeof(int64_t) * (size_t)E);
        for (int64_t p = 0; p < N; p++)
            if (ids[p] >= 0 && ids[p] < E) order[next[ids[p]]++] = p;
        free(next);
    }
    char *xe = malloc((size_t)(most * D) * xs + 64), *gu = malloc((size_t)(most * 2 * I) * xs + 64);
    char *h = malloc((size_t)(most * I) * xs + 64), *ye = malloc((size_t)(most * D) * xs + 64);
    int rc = xe && gu && h && ye ? 0 : -1;
    for (int64_t e = 0; e < E && !rc; e++) {
        const int64_t c0 = count[e], n = count[e + 1] - c0;
        if (!n) continue;
        for (int64_t r = 0; r < n; r++)
            memcpy(xe + r * D * xs, (const char *)x + (order[c0 + r] / K) * D * xs, (size_t)D * xs);
        const int k = x_bf16 && bf16dot_rows && bf16dot_rows[mx_bucket(n)] ? MX_BF16DOT : kernel;
        rc = shuttle_mxfp4_linear(xe, x_bf16, n, D, (const uint8_t *)w13[e], (const uint8_t *)s13[e],
                                  b13 ? (const float *)b13[e] : NULL, 2 * I, gu, x_bf16, nthreads, k);
        if (rc) break;
        activation(gu, h, n, I, x_bf16, alpha, limit, up_offset, nthreads);
        rc = shuttle_mxfp4_linear(h, x_bf16, n, I, (const uint8_t *)w2[e], (const uint8_t *)s2[e],
                                  b2 ? (const float *)b2[e] : NULL, D, ye, x_bf16, nthreads, k);
        if (rc) break;
        combine(ye, order + c0, wk, K, n, D, y, x_bf16, nthreads);
    }
    free(xe), free(gu), free(h), free(ye), free(count), free(order);
    return rc;
}
