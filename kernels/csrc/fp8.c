/* FP8 (e4m3fn) tokens for M2N dispatch (--m2n-dtype fp8, m2n_comm/m2n.py): per-row scaling to
 * float8 and back, eight values at a time with AVX2. torch's CPU conversions from float8 run one
 * value at a time (about 6 ns a value here), more than the bytes they save on a host's links.
 *
 * e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; normal values 2^-6 .. 448, subnormals
 * m * 2^-9; no infinity (0x7f / 0xff are NaN, never written here: values are scaled into range).
 * Quantize: scale = amax(row) / 448, at least float32's smallest normal, rounded to the row's dtype;
 * q = e4m3(x * (1 / scale)) rounded to nearest even, as torch's x.float() * (1 / scale.float()) then
 * .to(float8_e4m3fn) does. Dequantize: x = float(q) * scale, rounded to the output dtype (nearest
 * even) as torch's q.to(dtype) * scale does. */
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

/* x (T, D) bf16 or float32 -> q (T, D) e4m3fn codes and scale (T) in x's dtype. */
void shuttle_fp8_quantize(const void *x, uint8_t *q, void *scale, int64_t T, int64_t D, int bf16) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t base = t * D;
        __m256 m8 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= D; i += 8)
            m8 = _mm256_max_ps(m8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), load8(x, base + i, bf16)));
        float m[8], amax = 0.0f;
        _mm256_storeu_ps(m, m8);
        for (int k = 0; k < 8; k++) amax = m[k] > amax ? m[k] : amax;
        for (; i < D; i++) amax = fabsf(load_f(x, base + i, bf16)) > amax ? fabsf(load_f(x, base + i, bf16)) : amax;
        float s = amax / 448.0f;
        s = s > 1.17549435e-38f ? s : 1.17549435e-38f; /* float32's smallest normal: 1 / s is finite */
        if (bf16) {
            s = rbf(s);
            ((uint16_t *)scale)[t] = to_bf(s);
        } else {
            ((float *)scale)[t] = s;
        }
        const float inv = 1.0f / s;
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
}

/* q (T, D) e4m3fn codes and scale (T) -> x (T, D), all in one dtype (bf16 or float32). */
void shuttle_fp8_dequantize(const uint8_t *q, const void *scale, void *x, int64_t T, int64_t D, int bf16) {
    for (int64_t t = 0; t < T; t++) {
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
}
