/* FP8 (e4m3fn) tokens for M2N dispatch (--m2n-dtype fp8, m2n_comm/m2n.py): per-row scaling to
 * float8 and back, 16 values at a time with AVX-512 where the CPU has it (avx512 set), else 8 with AVX2,
 * the rows split over OpenMP threads once a call is large enough to pay for waking them. torch's CPU
 * conversions from float8 run one value at a time (about 6 ns a value here), more than the bytes they
 * save on a host's links.
 *
 * e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; normal values 2^-6 .. 448, subnormals
 * m * 2^-9; no infinity (0x7f / 0xff are NaN, never written here: values are scaled into range).
 * Quantize: scale = amax(row) / 448, at least float32's smallest normal, rounded to the row's dtype;
 * q = e4m3(x * (1 / scale)) rounded to nearest even, as torch's x.float() * (1 / scale.float()) then
 * .to(float8_e4m3fn) does. Dequantize: x = float(q) * scale, rounded to the output dtype (nearest
 * even) as torch's q.to(dtype) * scale does. Both widths compute the same operations lane by lane, so
 * they give the same bits. */
#include "bf16_avx2.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float load_f(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline __m256 load8(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16x8_to_f32((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

/* Eight floats (|v| <= 448) to e4m3fn codes in the low byte of each lane. */
static inline __m256i e4m3_8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    /* normal: round the mantissa to 3 bits (nearest even), then re-bias the exponent 127 -> 7 */
    const __m256i ab = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(ab, 20), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(ab, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), lsb));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
    /* subnormal (|v| < 2^-6): m = round(|v| * 2^9), 8 being the smallest normal's code */
    const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)));
    const __m256 tiny = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
    __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(tiny));
    code = _mm256_min_epi32(code, _mm256_set1_epi32(0x7E)); /* 448 at most */
    return _mm256_or_si256(code, sign);
}

/* Eight e4m3fn codes (low bytes of the lanes) to floats. */
static inline __m256 from_e4m3_8(__m256i b) {
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em);
    const __m256 mag = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
    return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
}

static inline uint8_t e4m3_1(float v) {
    uint8_t out[32];
    const __m256i c = e4m3_8(_mm256_set1_ps(v));
    memcpy(out, &c, sizeof c);
    return out[0];
}

static inline float from_e4m3_1(uint8_t q) {
    float out[8];
    _mm256_storeu_ps(out, from_e4m3_8(_mm256_set1_epi32(q)));
    return out[0];
}

/* Row scale: amax / 448, at least float32's smallest normal (1 / s is finite), rounded to the row's
 * dtype and stored; returns it. */
static inline float row_scale(float amax, void *scale, int64_t t, int bf16) {
    float s = amax / 448.0f;
    s = s > 1.17549435e-38f ? s : 1.17549435e-38f;
    if (bf16) {
        s = rbf(s);
        ((uint16_t *)scale)[t] = to_bf(s);
    } else {
        ((float *)scale)[t] = s;
    }
    return s;
}

/* Row t of x (T, D) -> its codes and scale, AVX2. */
static void quantize_row8(const void *x, uint8_t *q, void *scale, int64_t t, int64_t D, int bf16) {
    const int64_t base = t * D;
    __m256 m8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        m8 = _mm256_max_ps(m8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), load8(x, base + i, bf16)));
    float m[8], amax = 0.0f;
    _mm256_storeu_ps(m, m8);
    for (int k = 0; k < 8; k++) amax = m[k] > amax ? m[k] : amax;
    for (; i < D; i++) amax = fabsf(load_f(x, base + i, bf16)) > amax ? fabsf(load_f(x, base + i, bf16)) : amax;
    const float inv = 1.0f / row_scale(amax, scale, t, bf16);
    const __m256 r8 = _mm256_set1_ps(inv), lim = _mm256_set1_ps(448.0f);
    for (i = 0; i + 8 <= D; i += 8) {
        __m256 v = _mm256_mul_ps(load8(x, base + i, bf16), r8);
        v = _mm256_max_ps(_mm256_min_ps(v, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
        const __m256i c = e4m3_8(v);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64((__m128i *)(q + base + i), _mm_packus_epi16(w, w));
    }
    for (; i < D; i++) {
        float v = load_f(x, base + i, bf16) * inv;
        q[base + i] = e4m3_1(v > 448.0f ? 448.0f : v < -448.0f ? -448.0f : v);
    }
}

/* Row t of q (T, D) and its scale -> row t of x, AVX2. */
static void dequantize_row8(const uint8_t *q, const void *scale, void *x, int64_t t, int64_t D, int bf16) {
    const int64_t base = t * D;
    const float s = load_f(scale, t, bf16);
    const __m256 s8 = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + base + i)));
        /* torch rounds q to the dtype first (exact: e4m3 values fit bf16), then multiplies */
        const __m256 v = _mm256_mul_ps(from_e4m3_8(b), s8);
        if (bf16)
            store_bf8((uint16_t *)x + base + i, v);
        else
            _mm256_storeu_ps((float *)x + base + i, v);
    }
    for (; i < D; i++) {
        const float v = from_e4m3_1(q[base + i]) * s;
        if (bf16)
            ((uint16_t *)x)[base + i] = to_bf(v);
        else
            ((float *)x)[base + i] = v;
    }
}

#if defined(__clang__) ? __clang_major__ >= 8 : __GNUC__ >= 8
#define FP8_AVX512 1
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AI512 T512 static inline __attribute__((always_inline))

/* n (<= 16) values of row x from index i as floats (0 past n) */
AI512 __m512 load16(const void *x, int64_t i, __mmask16 m, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)x + i);
}

/* e4m3_8's operations on 16 lanes */
AI512 __m512i e4m3_16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __m512 a = _mm512_abs_ps(v);
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), lsb));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
    const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)));
    const __mmask16 tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    const __m512i code = _mm512_min_epi32(_mm512_mask_blend_epi32(tiny, normal, sub), _mm512_set1_epi32(0x7E));
    return _mm512_or_si512(code, sign);
}

/* from_e4m3_8's operations on 16 lanes */
AI512 __m512 from_e4m3_16(__m512i b) {
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f));
    const __m512 mag = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(_mm512_set1_epi32(8), em), normal, sub);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

T512 static void quantize_row16(const void *x, uint8_t *q, void *scale, int64_t t, int64_t D, int bf16) {
    const int64_t base = t * D;
    __m512 m16 = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
        const __mmask16 m = D - i >= 16 ? 0xFFFF : (__mmask16)((1u << (D - i)) - 1);
        m16 = _mm512_max_ps(m16, _mm512_abs_ps(load16(x, base + i, m, bf16)));
    }
    const float inv = 1.0f / row_scale(_mm512_reduce_max_ps(m16), scale, t, bf16);
    const __m512 r16 = _mm512_set1_ps(inv), lim = _mm512_set1_ps(448.0f), neg = _mm512_set1_ps(-448.0f);
    for (int64_t i = 0; i < D; i += 16) {
        const __mmask16 m = D - i >= 16 ? 0xFFFF : (__mmask16)((1u << (D - i)) - 1);
        const __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(load16(x, base + i, m, bf16), r16), lim), neg);
        _mm512_mask_cvtepi32_storeu_epi8(q + base + i, m, e4m3_16(v));
    }
}

T512 static void dequantize_row16(const uint8_t *q, const void *scale, void *x, int64_t t, int64_t D, int bf16) {
    const int64_t base = t * D;
    const __m512 s16 = _mm512_set1_ps(load_f(scale, t, bf16));
    for (int64_t i = 0; i < D; i += 16) {
        const __mmask16 m = D - i >= 16 ? 0xFFFF : (__mmask16)((1u << (D - i)) - 1);
        const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, q + base + i));
        const __m512 v = _mm512_mul_ps(from_e4m3_16(b), s16);
        if (bf16) { /* round_bits8's rounding, 16 lanes */
            const __m512i u = _mm512_castps_si512(v);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
            _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)x + base + i, m, r);
        } else {
            _mm512_mask_storeu_ps((float *)x + base + i, m, v);
        }
    }
}
#endif

/* Whether a call of T rows of D values splits its rows over nthreads threads: from 2^14 values with
 * spinning threads (8 x 2048 bf16 on the Zen 5 EPYC, AVX-512: quantize 4.2 -> 3.0 us), from 2^20 with
 * passive waits, whose wake-up (about 40 us there) one thread's 2^18 values still beat (45 against 65 us). */
static inline int fp8_parallel(int64_t T, int64_t D, int nthreads) {
    return nthreads > 1 && T > 1 && T * D >= (passive_waits() ? 1 << 20 : 1 << 14);
}

/* 1 where the AVX-512 loops were compiled in (the caller passes avx512 only where the CPU has it, too) */
int shuttle_fp8_avx512_built(void) {
#ifdef FP8_AVX512
    return 1;
#else
    return 0;
#endif
}

/* x (T, D) bf16 or float32 -> q (T, D) e4m3fn codes and scale (T) in x's dtype. */
void shuttle_fp8_quantize(const void *x, uint8_t *q, void *scale, int64_t T, int64_t D, int bf16, int avx512,
                          int nthreads) {
    #pragma omp parallel for num_threads(fp8_parallel(T, D, nthreads) ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
#ifdef FP8_AVX512
        if (avx512) {
            quantize_row16(x, q, scale, t, D, bf16);
            continue;
        }
#endif
        quantize_row8(x, q, scale, t, D, bf16);
    }
}

/* q (T, D) e4m3fn codes and scale (T) -> x (T, D), all in one dtype (bf16 or float32). */
void shuttle_fp8_dequantize(const uint8_t *q, const void *scale, void *x, int64_t T, int64_t D, int bf16, int avx512,
                            int nthreads) {
    #pragma omp parallel for num_threads(fp8_parallel(T, D, nthreads) ? nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
#ifdef FP8_AVX512
        if (avx512) {
            dequantize_row16(q, scale, x, t, D, bf16);
            continue;
        }
#endif
        dequantize_row8(q, scale, x, t, D, bf16);
    }
}
