/* y[T,O] = x[T,I] W[O,I]^T for few rows T, with W stored in bfloat16 and x, y in float32.
 *
 * Decode GEMMs on a CPU read every weight once for a handful of rows, so they run at the speed
 * weights stream from memory. Keeping them in bfloat16 halves the bytes; this kernel widens them
 * to float32 in registers (a bf16 is the top half of a float32: zero-extend and shift by 16) and
 * accumulates in float32 with FMA, so a row's result equals a float32 GEMM over the same
 * (bf16-exact) weights up to summation order. AVX2 + FMA; OpenMP over blocks of 4 outputs.
 *
 * Tile: 4 outputs x 2 rows = 8 ymm accumulators, the 4 weight vectors shared by both rows; a
 * block's 4 weight rows stay in L1 while every row pair of x passes over them. Tails: I not a
 * multiple of 8 (scalar), O not a multiple of 4 (the block repeats its last row), T odd (the last
 * pair computes its row twice).
 */
#include "bf16_avx2.h"

void shuttle_gemm_bf16(const float *x, const uint16_t *w, float *y, int64_t T, int64_t I, int64_t O,
                       int nthreads) {
    const int64_t blocks = (O + 3) / 4, I8 = I & ~(int64_t)7;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t o0 = b * 4, no = O - o0 < 4 ? O - o0 : 4;
        const uint16_t *w0 = w + o0 * I;
        const uint16_t *w1 = w0 + (no > 1 ? 1 : 0) * I, *w2 = w0 + (no > 2 ? 2 : 0) * I;
        const uint16_t *w3 = w0 + (no > 3 ? 3 : 0) * I;
        for (int64_t t = 0; t < T; t += 2) {
            const int two = t + 1 < T;
            const float *x0 = x + t * I, *x1 = two ? x0 + I : x0;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
            for (int64_t i = 0; i < I8; i += 8) {
                const __m256 v0 = bf16x8_to_f32(w0 + i), v1 = bf16x8_to_f32(w1 + i), v2 = bf16x8_to_f32(w2 + i), v3 = bf16x8_to_f32(w3 + i);
                const __m256 p = _mm256_loadu_ps(x0 + i), q = _mm256_loadu_ps(x1 + i);
                a0 = _mm256_fmadd_ps(p, v0, a0); a1 = _mm256_fmadd_ps(p, v1, a1);
                a2 = _mm256_fmadd_ps(p, v2, a2); a3 = _mm256_fmadd_ps(p, v3, a3);
                c0 = _mm256_fmadd_ps(q, v0, c0); c1 = _mm256_fmadd_ps(q, v1, c1);
                c2 = _mm256_fmadd_ps(q, v2, c2); c3 = _mm256_fmadd_ps(q, v3, c3);
            }
            float r[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
            float s[4] = {hsum8(c0), hsum8(c1), hsum8(c2), hsum8(c3)};
            const uint16_t *ws[4] = {w0, w1, w2, w3};
            for (int64_t i = I8; i < I; i++) {
                for (int k = 0; k < 4; k++) {
                    const float v = bf16_to_f32(ws[k][i]);
                    r[k] += x0[i] * v;
                    s[k] += x1[i] * v;
                }
            }
            for (int64_t k = 0; k < no; k++) {
                y[t * O + o0 + k] = r[k];
                if (two) y[(t + 1) * O + o0 + k] = s[k];
            }
        }
    }
}
