/* Decode attention straight from a paged KV cache: one query token per sequence, G query heads per
 * kv head, keys and values in bfloat16 or float32, all arithmetic in float32.
 *
 * The torch path gathers every sequence's pages into one (B, K, S', H) tensor and runs the flash
 * kernel on it: at decode sizes the copy and the kernel's per-(sequence, head) set-up cost several
 * times what reading the keys and values once does. Here each (sequence, kv head) pair walks its
 * pages in place, 64 positions at a time (across page boundaries), with an online softmax (running
 * max m, running sum l, rescaled accumulator): scores s = scale q.k for the G query heads, then
 * p = exp(s - m), then acc += p v. Every key and value is read once, by one thread. OpenMP over the B*K pairs
 * (dynamic: contexts differ), except that consecutive rows of one sequence (a verify step's 1 + k
 * rows) are one item per kv head, which reads each key and value once for all of them (run_rows).
 * AVX2 + FMA, H any size (vectors of 8, then a scalar tail); or AVX-512 (vectors of 16) where H is
 * a multiple of 16 and the CPU has it.
 *
 * Visibility: sequence b sees positions [start[b], len[b]) (start > 0 under a sliding window or in a
 * later chunk of chunked attention); position j lives in page table[b*M + j/S], slot j%S. Keys have
 * H entries, values V (V < H: MiMo-V2-Flash's narrower value heads). Outputs o (B, K, G, V) and the
 * natural-log log-sum-exp of the scaled scores (B, K, G), which attention sinks need. The AVX-512
 * loops need both H and V multiples of 16. */
#include "bf16_avx2.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64 /* positions scored before their values are accumulated */
#define PREFETCH 8 /* positions ahead whose key rows are fetched */

static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

static inline __m256 load8(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16x8_to_f32((const uint16_t *)base + i) : _mm256_loadu_ps((const float *)base + i);
}

static inline float load1(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

#define AI static inline __attribute__((always_inline))

/* s[g] = scale q_g . k for GN query heads at once: each widened key vector feeds GN FMAs. */
AI void score_group(const float *qb, const void *kr, const int bf16, int64_t H, float scale, const int GN, float *s,
                    int64_t stride) {
    __m256 a[4];
    for (int g = 0; g < GN; g++) a[g] = _mm256_setzero_ps();
    const int64_t H8 = H & ~(int64_t)7;
    for (int64_t i = 0; i < H8; i += 8) {
        const __m256 k = load8(kr, i, bf16);
        for (int g = 0; g < GN; g++) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * H + i), k, a[g]);
    }
    for (int g = 0; g < GN; g++) {
        float d = hsum8(a[g]);
        for (int64_t i = H8; i < H; i++) d += qb[g * H + i] * load1(kr, i, bf16);
        s[g * stride] = d * scale;
    }
}

/* acc_g += sum_j p_g[j] v_j over n positions (V columns) for GN query heads, 8 columns at a time in registers. */
AI void value_group(float *acc, const float *p, int64_t pstride, const char *vp, const int64_t *vrow, int64_t n,
                    const int bf16, int64_t V, const int GN) {
    const int64_t V8 = V & ~(int64_t)7;
    for (int64_t i = 0; i < V8; i += 8) {
        __m256 a[4];
        for (int g = 0; g < GN; g++) a[g] = _mm256_loadu_ps(acc + g * V + i);
        for (int64_t j = 0; j < n; j++) {
            const __m256 v = load8(vp + vrow[j], i, bf16);
            for (int g = 0; g < GN; g++) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * pstride + j), v, a[g]);
        }
        for (int g = 0; g < GN; g++) _mm256_storeu_ps(acc + g * V + i, a[g]);
    }
    for (int64_t i = V8; i < V; i++)
        for (int64_t j = 0; j < n; j++) {
            const float v = load1(vp + vrow[j], i, bf16);
            for (int g = 0; g < GN; g++) acc[g * V + i] += p[g * pstride + j] * v;
        }
}

/* The same two groups with 16-wide AVX-512 vectors, for H a multiple of 16 on CPUs that have it
 * (half the instructions of the 8-wide ones: measured 1.6-1.9x on the AVX-512 EPYC). Not
 * always_inline: the AVX2 build of attend() calls them only in a branch it never takes. */
#define T512 __attribute__((target("avx512f")))

T512 static inline __m512 load16(const void *base, int64_t i, const int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* The sums of four vectors at once, [sum a0, sum a1, sum a2, sum a3]: 11 shuffles and adds where four
 * reductions take about 32 (a decode score is 4 FMAs at H = 64, so the reductions were most of it). */
T512 static inline __m128 hsum16x4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

T512 static inline void score_group16(const float *qb, const void *kr, const int bf16, int64_t H, float scale,
                                      const int GN, float *s, int64_t stride) {
    __m512 a[4];
    for (int g = 0; g < 4; g++) a[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
        const __m512 k = load16(kr, i, bf16);
        for (int g = 0; g < GN; g++) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qb + g * H + i), k, a[g]);
    }
    float d[4];
    _mm_storeu_ps(d, _mm_mul_ps(hsum16x4(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale)));
    for (int g = 0; g < GN; g++) s[g * stride] = d[g];
}

T512 static inline void value_group16(float *acc, const float *p, int64_t pstride, const char *vp,
                                      const int64_t *vrow, int64_t n, const int bf16, int64_t V, const int GN) {
    for (int64_t i = 0; i < V; i += 16) {
        __m512 a[4];
        for (int g = 0; g < GN; g++) a[g] = _mm512_loadu_ps(acc + g * V + i);
        for (int64_t j = 0; j < n; j++) {
            const __m512 v = load16(vp + vrow[j], i, bf16);
            for (int g = 0; g < GN; g++) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * pstride + j]), v, a[g]);
        }
        for (int g = 0; g < GN; g++) _mm512_storeu_ps(acc + g * V + i, a[g]);
    }
}

#define BY_GROUP(call)                          \
    for (int64_t g0 = 0; g0 < GQ; g0 += 4) {    \
        switch (GQ - g0 < 4 ? GQ - g0 : 4) {    \
            case 4: call(4); break;             \
            case 3: call(3); break;             \
            case 2: call(2); break;             \
            default: call(1); break;            \
        }                                       \
    }

/* Query heads one work item may hold (a run of rows of one sequence times G). */
#define RUN_HEADS 32

/* Rows b of a run: the rows after its first are the same sequence's next positions (a speculative
 * verify step, or a prompt chunk as one-token rows): the same pages and start, each one position
 * longer than the row before. Such a run is one work item per kv head, its keys and values read once
 * for all its rows. Returns the run's row count starting at b (at most max_rows). */
static int64_t run_rows(const int64_t *table, int64_t M, const int64_t *start, const int64_t *len, int64_t B,
                        int64_t b, int64_t max_rows) {
    int64_t n = 1;
    while (n < max_rows && b + n < B && start[b + n] == start[b] && len[b + n] == len[b + n - 1] + 1
           && !memcmp(table + (b + n) * M, table + b * M, (size_t)M * 8))
        n++;
    return n;
}

AI void attend(const int wide, const void *q, const void *k_cache, const void *v_cache, const int bf16, const int64_t *table,
               int64_t M, const int64_t *start, const int64_t *len, void *o, float *lse, int64_t B, int64_t K,
               int64_t G, int64_t H, int64_t V, int64_t S, int64_t k_page, int64_t k_slot, int64_t k_head,
               int64_t v_page, int64_t v_slot, int64_t v_head, float scale, int nthreads, const int q_bf16,
               const int o_bf16) {
    const int64_t V8 = V & ~(int64_t)7, esz = bf16 ? 2 : 4, row_bytes = H * esz, v_bytes = V * esz;
    const char *kp = (const char *)k_cache, *vp = (const char *)v_cache;
    if (passive_waits()) { /* one thread unless the call is worth a wake-up: ~100 us of key and value rows */
        int64_t rows = 0;
        for (int64_t b = 0; b < B; b++) rows += len[b] - start[b];
        if (rows * K * (H + V) < 640 * 1024) nthreads = 1;
    }
    /* The work items: runs of rows (run_rows) times kv heads. */
    const int64_t max_rows = G >= RUN_HEADS ? 1 : RUN_HEADS / G;
    int64_t first[B + 1], runs = 0, most = 1;
    for (int64_t b = 0; b < B; runs++) {
        const int64_t n = run_rows(table, M, start, len, B, b, max_rows);
        first[runs] = b, b += n, most = n > most ? n : most;
    }
    first[runs] = B;
    const int64_t items = runs * K, chunk = items <= 4 * (int64_t)nthreads ? 1 : 4;
    #pragma omp parallel num_threads(nthreads)
    {
        float s[most * G][BLOCK + 8], m[most * G], l[most * G], acc[most * G * V], qf[most * G * H];
        int64_t krow[BLOCK], vrow[BLOCK];
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t item = 0; item < items; item++) {
            const int64_t run = item / K, kh = item % K, b = first[run], R = first[run + 1] - b, GQ = R * G;
            const int64_t pair = b * K + kh; /* the run's first row's (sequence, kv head) */
            const float *qb = (const float *)q + pair * G * H;
            if (q_bf16 || R > 1) { /* the queries in float32, the run's rows' heads in order (bf16: widened here) */
                for (int64_t r = 0; r < R; r++)
                    for (int64_t i = 0; i < G * H; i++) {
                        const int64_t at = ((b + r) * K + kh) * G * H + i;
                        qf[r * G * H + i] = q_bf16 ? bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at];
                    }
                qb = qf;
            }
            for (int64_t g = 0; g < GQ; g++) m[g] = -INFINITY, l[g] = 0.0f;
            memset(acc, 0, sizeof(float) * GQ * V);
            const int64_t end = len[b + R - 1];
            for (int64_t j0 = start[b]; j0 < end;) {
                /* a block of up to BLOCK positions, across pages: one softmax rescale per block */
                const int64_t n = end - j0 < BLOCK ? end - j0 : BLOCK;
                int64_t entry = j0 / S, slot = j0 % S, page = table[b * M + entry];
                for (int64_t j = 0; j < n; j++, slot++) {
                    if (slot == S) slot = 0, page = table[b * M + ++entry];
                    krow[j] = esz * (page * k_page + slot * k_slot + kh * k_head);
                    vrow[j] = esz * (page * v_page + slot * v_slot + kh * v_head);
                }
                /* The rows are scattered (pages, heads interleaved in a slot): ask for them ahead, keys
                 * PREFETCH positions before they are scored, values while the keys are. */
                for (int64_t j = 0; j < n && j < PREFETCH; j++) prefetch_row(kp + krow[j], row_bytes);
                for (int64_t j = 0; j < n; j++) {
                    if (j + PREFETCH < n) prefetch_row(kp + krow[j + PREFETCH], row_bytes);
                    prefetch_row(vp + vrow[j], v_bytes);
                    const void *kr = kp + krow[j];
#define SCORE(GN) if (wide) score_group16(qb + g0 * H, kr, bf16, H, scale, GN, &s[g0][j], BLOCK + 8); \
                  else score_group(qb + g0 * H, kr, bf16, H, scale, GN, &s[g0][j], BLOCK + 8)
                    BY_GROUP(SCORE)
#undef SCORE
                }
                /* a run's row r sees positions < len[b + r]: the later ones score -inf (weight 0, as
                 * the padding below), so each row's sums are those of its own walk */
                for (int64_t r = 0; r + 1 < R; r++)
                    for (int64_t j = len[b + r] > j0 ? len[b + r] - j0 : 0; j < n; j++)
                        for (int64_t g = 0; g < G; g++) s[r * G + g][j] = -INFINITY;
                for (int64_t g = 0; g < GQ; g++) {
                    float mx = m[g];
                    for (int64_t j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
                    const float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
                    for (int64_t j = n; j < ((n + 7) & ~(int64_t)7); j++) s[g][j] = -INFINITY;
                    const __m256 mv = _mm256_set1_ps(mx);
                    __m256 sum = _mm256_setzero_ps();
                    for (int64_t j = 0; j < n; j += 8) {
                        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s[g] + j), mv));
                        _mm256_storeu_ps(s[g] + j, p);
                        sum = _mm256_add_ps(sum, p);
                    }
                    l[g] = l[g] * corr + hsum8(sum);
                    m[g] = mx;
                    if (corr != 1.0f) {
                        float *ag = acc + g * V;
                        const __m256 c = _mm256_set1_ps(corr);
                        for (int64_t i = 0; i < V8; i += 8)
                            _mm256_storeu_ps(ag + i, _mm256_mul_ps(_mm256_loadu_ps(ag + i), c));
                        for (int64_t i = V8; i < V; i++) ag[i] *= corr;
                    }
                }
#define VALUE(GN) if (wide) value_group16(acc + g0 * V, s[g0], BLOCK + 8, vp, vrow, n, bf16, V, GN); \
                  else value_group(acc + g0 * V, s[g0], BLOCK + 8, vp, vrow, n, bf16, V, GN)
                BY_GROUP(VALUE)
#undef VALUE
                j0 += n;
            }
            for (int64_t g = 0; g < GQ; g++) {
                const int64_t out = ((b + g / G) * K + kh) * G + g % G; /* (row, kv head, query head) */
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                if (o_bf16) { /* rounded to nearest even, as torch's cast to bf16 */
                    uint16_t *og = (uint16_t *)o + out * V;
                    for (int64_t i = 0; i < V; i++) og[i] = to_bf(acc[g * V + i] * inv);
                } else {
                    float *og = (float *)o + out * V;
                    for (int64_t i = 0; i < V; i++) og[i] = acc[g * V + i] * inv;
                }
                lse[out] = l[g] > 0.0f ? m[g] + logf(l[g]) : -INFINITY;
            }
        }
    }
}

#define ARGS q, k_cache, v_cache, bf16, table, M, start, len, o, lse, B, K, G, H, V, S, k_page, k_slot, k_head, \
             v_page, v_slot, v_head, scale, nthreads, q_bf16, o_bf16
#define PARAMS const void *q, const void *k_cache, const void *v_cache, int bf16, const int64_t *table, int64_t M, \
               const int64_t *start, const int64_t *len, void *o, float *lse, int64_t B, int64_t K, int64_t G, \
               int64_t H, int64_t V, int64_t S, int64_t k_page, int64_t k_slot, int64_t k_head, int64_t v_page, \
               int64_t v_slot, int64_t v_head, float scale, int nthreads, int q_bf16, int o_bf16

static void attend_avx2(PARAMS) {
    if (bf16) attend(0, q, k_cache, v_cache, 1, table, M, start, len, o, lse, B, K, G, H, V, S, k_page, k_slot, k_head,
                     v_page, v_slot, v_head, scale, nthreads, q_bf16, o_bf16);
    else attend(0, q, k_cache, v_cache, 0, table, M, start, len, o, lse, B, K, G, H, V, S, k_page, k_slot, k_head,
                v_page, v_slot, v_head, scale, nthreads, q_bf16, o_bf16);
}

T512 static void attend_avx512(PARAMS) {
    if (bf16) attend(1, q, k_cache, v_cache, 1, table, M, start, len, o, lse, B, K, G, H, V, S, k_page, k_slot, k_head,
                     v_page, v_slot, v_head, scale, nthreads, q_bf16, o_bf16);
    else attend(1, q, k_cache, v_cache, 0, table, M, start, len, o, lse, B, K, G, H, V, S, k_page, k_slot, k_head,
                v_page, v_slot, v_head, scale, nthreads, q_bf16, o_bf16);
}

/* q_bf16 / o_bf16: the query is read, the output written, in bf16 (else float32; the log-sum-exp is
 * float32 always). allow_wide: take the AVX-512 loops where H and V allow and the CPU has them (0: the
 * AVX2 ones, for tests). */
void shuttle_paged_decode_attention(PARAMS, int allow_wide) {
    if (allow_wide && H % 16 == 0 && V % 16 == 0 && __builtin_cpu_supports("avx512f"))
        attend_avx512(ARGS);
    else
        attend_avx2(ARGS);
}
