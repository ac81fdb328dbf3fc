/* Helpers the native kernels share: bfloat16 is the top half of a float32, so widening is a
 * zero-extend and a shift by 16; rounding back to it; the horizontal sum of 8 floats; OpenMP's wait
 * policy; and the constants of Cephes' expf (e^x = 2^n e^r, n = round(x log2 e), r = x - n ln 2 in
 * two parts, e^r a degree-6 polynomial) that the AVX2 exp8 and the AVX-512 exp16 both evaluate. */
#ifndef SHUTTLE_BF16_AVX2_H
#define SHUTTLE_BF16_AVX2_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rounding to bf16, nearest even, as torch rounds: one float, or eight at a time (kept as floats, or
 * packed). */
static inline uint16_t to_bf(float f) { /* round to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float rbf(float f) { return bf16_to_f32(to_bf(f)); }

static inline __m256i round_bits8(__m256 f) { /* the rounded bf16 in each lane's top half */
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u));
}

static inline __m256 rbf8(__m256 f) { return _mm256_castsi256_ps(round_bits8(f)); }

static inline void store_bf8(uint16_t *p, __m256 f) {
    const __m256i h = _mm256_srli_epi32(round_bits8(f), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* Whether OpenMP runs with passive waits (OMP_WAIT_POLICY=PASSIVE, as the worker pools do:
 * pools/launchers.py): the other threads sleep after each parallel region, and waking one costs
 * 20-60 us on the AVX-512 EPYC, so a region needs more work to pay for it. An RMSNorm / rotary
 * call of 64 tokens (425M shapes) took 42 / 36 us on 2 passive threads against 34 / 28 on 1, and
 * 256 tokens about even; with spinning threads 2 threads were 1.6-1.9x faster from 64 tokens on. */
static inline int passive_waits(void) {
    static int passive = -1; /* read once; a race only writes the same value */
    if (passive < 0) {
        const char *p = getenv("OMP_WAIT_POLICY");
        passive = p != NULL && (p[0] == 'p' || p[0] == 'P');
    }
    return passive;
}

#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
/* Run call(R) with R a compile-time constant 1..8 (R > 8 or < 1: 1), so row-blocked kernels get
   their accumulators in registers for every row count of a tile. */
#define BY_ROWS(n, call)        \
    switch (n) {                \
        case 8: call(8); break; \
        case 7: call(7); break; \
        case 6: call(6); break; \
        case 5: call(5); break; \
        case 4: call(4); break; \
        case 3: call(3); break; \
        case 2: call(2); break; \
        default: call(1); break; \
    }

#endif
