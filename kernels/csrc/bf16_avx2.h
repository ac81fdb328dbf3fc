/* Helpers the native kernels share: bfloat16 is the top half of a float32, so widening is a
 * zero-extend and a shift by 16; rounding back to it; the horizontal sum of 8 floats; OpenMP's wait
 * policy; the MoE blocks' spin-then-yield barrier; and Cephes' expf (e^x = 2^n e^r, n = round(x
 * log2 e), r = x - n ln 2 in two parts, e^r a degree-6 polynomial) that the AVX2 exp8 and the
 * AVX-512 exp16 both evaluate. */
#ifndef SHUTTLE_BF16_AVX2_H
#define SHUTTLE_BF16_AVX2_H
#include <immintrin.h>
#include <sched.h>
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

/* e^x for any float x, relative error ~2e-7: +inf above 88.72, 0 below -87.34. Paged attention's
 * scores (minus their running max) and the int8 block's SiLU on AVX2. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228f), lo = _mm256_set1_ps(-87.3365f);
    const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), x);
    __m256 y = _mm256_set1_ps(EXP_P0);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    /* 2^n in two halves, so that n = 128 (x near 88.7) does not overflow the exponent field */
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    y = _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), over);
    return _mm256_andnot_ps(under, y);
}

#if defined(__clang__) ? __clang_major__ >= 8 : __GNUC__ >= 8
/* exp8 sixteen at a time (AVX-512F; the same operations, so the same bits): the SiLU of the bf16 and
 * the int8 / FP8 MoE blocks' AVX-512 epilogues. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 exp16(__m512 x) {
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7228f), _CMP_GT_OQ);
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365f)), _mm512_set1_ps(88.7228f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), x);
    __m512 y = _mm512_set1_ps(EXP_P0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    /* 2^n in two halves so that n = 128 (x near 88.7) does not overflow the exponent field */
    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i half = _mm512_srai_epi32(ni, 1);
    const __m512 p1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(127)), 23));
    const __m512 p2 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, half), _mm512_set1_epi32(127)), 23));
    y = _mm512_mul_ps(_mm512_mul_ps(y, p1), p2);
    y = _mm512_mask_mov_ps(y, over, _mm512_set1_ps(__builtin_inff()));
    return _mm512_mask_mov_ps(y, under, _mm512_setzero_ps());
}
#endif

/* Every thread of the team waits here until all `nt` have arrived (once per counter; the bf16 and
 * int8 MoE blocks). The wait is the up phase's imbalance, a few us; under passive waits an omp barrier would put the early thread to
 * sleep and wake it (20-60 us here, once per MoE layer). It spins, then yields the core, so that an
 * oversubscribed host still lets the late thread run. The release/acquire pair publishes the up
 * phase's h rows to every thread's down phase. */
static inline void spin_barrier(int64_t *arrived, int nt) {
    __atomic_add_fetch(arrived, 1, __ATOMIC_ACQ_REL);
    for (int64_t i = 0; __atomic_load_n(arrived, __ATOMIC_ACQUIRE) < nt; i++) {
        if (i < 2000) _mm_pause(); /* ~50 us here; then every poll offers the core to whoever waits for it */
        else sched_yield();
    }
}

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

/* The same for 1..3 rows (the AVX2 kernels' tiles: 16 accumulators of two rows fit its registers). */
#define BY_ROWS3(n, call)       \
    switch (n) {                \
        case 3: call(3); break; \
        case 2: call(2); break; \
        default: call(1); break; \
    }

#endif
