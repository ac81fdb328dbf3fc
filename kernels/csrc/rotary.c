/* Rotary position embedding in place, for the CPU decode path: one call for q and k instead of
 * kernels/rotary.py's torch ops (two multiplies, the rotate-half copy, an add and the copy back, per
 * tensor: 40-190 us a layer at 1-256 tokens on the AVX-512 EPYC, most of it per-op cost).
 *
 * Neox layout: the first R dims of each head rotate as two halves, for i < R/2
 *     x'[i]       = x[i] cos[i]             - x[i + R/2] sin[i]
 *     x'[i + R/2] = x[i + R/2] cos[i + R/2] + x[i] sin[i + R/2]
 * rounded where torch's ops round: in bf16 each product and the sum (torch computes a bf16 op in
 * float32 and rounds its result); in float32 each product, without fusing the multiply into the add
 * (fp-contract off), so both dtypes give torch's bits. AVX2, 8 values at a time, then a scalar
 * tail; OpenMP over tokens once a call is large enough to pay for waking the second thread. */
#include "bf16_avx2.h"
#include <immintrin.h>
#include <stdint.h>

#define NOFUSE __attribute__((optimize("fp-contract=off")))

NOFUSE static void rotate_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 a = bf16x8_to_f32(x + i), b = bf16x8_to_f32(x + half + i);
        const __m256 c0 = bf16x8_to_f32(c + i), c1 = bf16x8_to_f32(c + half + i);
        const __m256 s0 = bf16x8_to_f32(s + i), s1 = bf16x8_to_f32(s + half + i);
        store_bf8(x + i, _mm256_sub_ps(rbf8(_mm256_mul_ps(a, c0)), rbf8(_mm256_mul_ps(b, s0))));
        store_bf8(x + half + i, _mm256_add_ps(rbf8(_mm256_mul_ps(b, c1)), rbf8(_mm256_mul_ps(a, s1))));
    }
    for (; i < half; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[half + i]);
        x[i] = to_bf(rbf(a * bf16_to_f32(c[i])) - rbf(b * bf16_to_f32(s[i])));
        x[half + i] = to_bf(rbf(b * bf16_to_f32(c[half + i])) + rbf(a * bf16_to_f32(s[half + i])));
    }
}

NOFUSE static void rotate_f32(float *x, const float *c, const float *s, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        const __m256 ac = _mm256_mul_ps(a, _mm256_loadu_ps(c + i)), bs = _mm256_mul_ps(b, _mm256_loadu_ps(s + i));
        const __m256 bc = _mm256_mul_ps(b, _mm256_loadu_ps(c + half + i));
        const __m256 as = _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i));
        _mm256_storeu_ps(x + i, _mm256_sub_ps(ac, bs));
        _mm256_storeu_ps(x + half + i, _mm256_add_ps(bc, as));
    }
    for (; i < half; i++) {
        const float a = x[i], b = x[half + i];
        const float ac = a * c[i], bs = b * s[i], bc = b * c[half + i], as = a * s[half + i];
        x[i] = ac - bs;
        x[half + i] = bc + as;
    }
}

/* q (T, NQ heads) and k (T, NK heads): strides in elements per token and per head, each head's first
 * R dims contiguous (R even); cos, sin: (T, R) contiguous; all bf16 (bf16 = 1) or all float32. */
void shuttle_rotary(void *q, int64_t NQ, int64_t q_tok, int64_t q_head, void *k, int64_t NK, int64_t k_tok,
                    int64_t k_head, const void *cos, const void *sin, int64_t T, int64_t R, int bf16, int nthreads) {
    const int parallel = nthreads > 1 && T > 1 && T * (NQ + NK) * R >= (passive_waits() ? 1 << 19 : 1 << 15);
    const int64_t esz = bf16 ? 2 : 4, half = R / 2;
    #pragma omp parallel for num_threads(parallel ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *c = (const char *)cos + t * R * esz, *s = (const char *)sin + t * R * esz;
        for (int64_t h = 0; h < NQ + NK; h++) {
            char *x = h < NQ ? (char *)q + (t * q_tok + h * q_head) * esz : (char *)k + (t * k_tok + (h - NQ) * k_head) * esz;
            if (bf16) rotate_bf16((uint16_t *)x, (const uint16_t *)c, (const uint16_t *)s, half);
            else rotate_f32((float *)x, (const float *)c, (const float *)s, half);
        }
    }
}
