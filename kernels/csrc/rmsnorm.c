/* RMSNorm with the residual add fused, for the CPU decode path: one call per norm instead of the
 * six torch ops of kernels/rmsnorm.py (add, cast, square, mean, rsqrt and cast, multiply), which
 * is what a norm costs at decode sizes (~30 us a call at 16 rows on the AVX-512 EPYC, 34 a step).
 *
 * Rounds where torch's bf16 path rounds: r = bf16(x + residual), s = 1 / sqrt(mean(float(r)^2) + eps),
 * n = bf16(r * s), y = bf16(w * n) (torch's bf16 ops compute in float32 and round the result). Only
 * the order of the sum of squares differs. float32: the same without the roundings.
 * AVX2 (8 values a time; a signalling NaN may round to infinity); OpenMP over rows once a call is
 * large enough to pay for waking the second thread. */
#include "bf16_avx2.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>


static inline float sum_squares(const float *r, int64_t D) {
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) {
        const __m256 p = _mm256_loadu_ps(r + i), q = _mm256_loadu_ps(r + i + 8);
        a = _mm256_fmadd_ps(p, p, a);
        b = _mm256_fmadd_ps(q, q, b);
    }
    float t = hsum8(_mm256_add_ps(a, b));
    for (; i < D; i++) t += r[i] * r[i];
    return t;
}

/* x, residual (may be NULL), weight: (T, D), (T, D), (D) in one dtype (bf16 or float32, contiguous);
 * writes y (T, D) and, with a residual, r_out (T, D) = x + residual. scratch: D floats per thread. */
void shuttle_add_rms_norm(const void *x, const void *residual, const void *weight, void *y, void *r_out, int64_t T,
                          int64_t D, float eps, int bf16, int nthreads) {
    const int parallel = nthreads > 1 && T > 1 && T * D >= (passive_waits() ? 1 << 19 : 1 << 15);
    #pragma omp parallel for num_threads(parallel ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float r[D];
        const int64_t D8 = D & ~(int64_t)7;
        if (bf16) {
            const uint16_t *xt = (const uint16_t *)x + t * D, *rt = residual ? (const uint16_t *)residual + t * D : 0;
            int64_t i = 0;
            if (rt)
                for (; i < D8; i += 8) _mm256_storeu_ps(r + i, rbf8(_mm256_add_ps(bf16x8_to_f32(xt + i), bf16x8_to_f32(rt + i))));
            else
                for (; i < D8; i += 8) _mm256_storeu_ps(r + i, bf16x8_to_f32(xt + i));
            for (; i < D; i++) r[i] = rt ? rbf(bf16_to_f32(xt[i]) + bf16_to_f32(rt[i])) : bf16_to_f32(xt[i]);
        } else {
            const float *xt = (const float *)x + t * D, *rt = residual ? (const float *)residual + t * D : 0;
            for (int64_t i = 0; i < D; i++) r[i] = rt ? xt[i] + rt[i] : xt[i];
        }
        const float s = 1.0f / sqrtf(sum_squares(r, D) / (float)D + eps);
        if (bf16) {
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *yt = (uint16_t *)y + t * D, *ro = r_out ? (uint16_t *)r_out + t * D : 0;
            const __m256 sv = _mm256_set1_ps(s);
            int64_t i = 0;
            for (; i < D8; i += 8) {
                const __m256 ri = _mm256_loadu_ps(r + i);
                store_bf8(yt + i, _mm256_mul_ps(bf16x8_to_f32(w + i), rbf8(_mm256_mul_ps(ri, sv))));
                if (ro) store_bf8(ro + i, ri);
            }
            for (; i < D; i++) {
                yt[i] = to_bf(bf16_to_f32(w[i]) * rbf(r[i] * s));
                if (ro) ro[i] = to_bf(r[i]);
            }
        } else {
            const float *w = (const float *)weight;
            float *yt = (float *)y + t * D, *ro = r_out ? (float *)r_out + t * D : 0;
            for (int64_t i = 0; i < D; i++) {
                yt[i] = w[i] * (r[i] * s);
                if (ro) ro[i] = r[i];
            }
        }
    }
}
