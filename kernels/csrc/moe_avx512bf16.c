/* The whole MoE block of one layer in one call, bfloat16, AVX-512 BF16:
 *     out[t] = sum over t's top-k experts e of w[t,k] * (silu(x[t] W1_e^T) * (x[t] W3_e^T)) W2_e^T
 * rounded to bf16 wherever torch's bf16 path rounds (kernels/moe.py: fused_moe_packed with oneDNN's
 * bf16 GEMMs): the gate and up outputs, silu(gate), the product, each expert's output, its weighted
 * value, and every partial sum of a token's outputs (added in ascending expert id, as unpermute's
 * index_add_ adds). So the two paths differ only where oneDNN's summation order or torch's exp
 * rounds differently.
 *
 * It replaces torch's sort / gather / per-expert GEMM calls / SiLU-mul / weighted scatter (about a
 * dozen ops per layer plus two GEMM calls per active expert) with:
 *  1. a counting sort of the T*K (token, expert) pairs by expert (stable);
 *  2. the gate/up GEMM with SiLU-mul in its epilogue, straight from x's rows (no gather copy):
 *     W13 packed so that each panel of 32 outputs holds 16 gate columns and the same 16 up columns
 *     (kernels/cpu_linear.ExpertPanels); the threads claim (expert, block of rows, panel) items in
 *     chunks as they go;
 *  3. the down GEMM, each thread owning a range of panels of 32 output columns and walking every
 *     expert for its columns, adding the weighted rows into out, so no two threads write one value.
 * A panel with more rows than one tile (8) is read from memory once and from cache by its other
 * tiles; those tiles prefetch the thread's next panel meanwhile, so memory streams all the time
 * (tile_prefetch: 1.16-1.26x at 12-32 rows per expert, where the block is bound by both).
 * Weight panels: pairs of inputs for 32 outputs, lane o of pair j = (w[o][2j], w[o][2j+1]), as in
 * gemm_avx512bf16.c; inputs padded with zeros to the panel's even width (D) or to a multiple of
 * 16 (the intermediate size I16: padded gate/up columns give h = silu(0) * 0 = 0).
 * Expert ids outside [0, E) are skipped (an expert worker's pairs for other workers). */
#include "bf16_avx2.h"
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Compilers without AVX-512 BF16 intrinsics (gcc < 10, clang < 9) build the rest of the library;
 * kernels/native.py asks shuttle_avx512bf16_built() before calling the kernel. */
#if defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10
int shuttle_avx512bf16_built(void) { return 1; }

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define AI512 T512 static inline __attribute__((always_inline))
#define MAX_R 8
#define ROW_BLOCK 128 /* rows of one expert per up-projection item */
/* the same for an expert on AMX: rows whose x (D = 1024: 1 MiB) stays in L2 while a panel is read
 * once for all of them */
#define AMX_ROW_BLOCK 512
#ifndef UP_CHUNK
/* up items (panels of 64 KiB at D = 1024) a thread claims at once: 32 streamed 2-4% faster than 4 at
 * 16 tokens and 3-5% at 64, 1-2% at 256 (8 layers of the 425M shapes, 2 threads, interleaved); the
 * last chunks still balance the threads within a few percent of the up phase */
#define UP_CHUNK 32
#endif
#ifndef PREFETCH
#define PREFETCH 48 /* k-pairs ahead (6 KiB): 16 and 128 measured 2-5% slower at 4-64 rows */
#endif

AI512 __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
AI512 __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
AI512 __m512 bf16_round(__m512 v) { return widen16(round16(v)); }

/* acc[r][0..1] = rows xr[r] (bf16 pairs) times one panel of 32 outputs over `pairs` input pairs.
 * While it computes, it also asks for `pf_lines` cache lines from `pf` into L2, spread evenly over
 * its iterations: a slice of the panel the thread takes next (see tile_prefetch).
 * once: no other tile reads this panel (the expert's rows fit one tile), so its lines come in
 * non-temporal: read once a step, experts bigger than the caches would only evict what stays warm
 * between steps (attention and head weights, the KV cache, the interpreter's data). */
AI512 void panel_dot(const uint32_t *const *xr, const uint32_t *pw, int64_t pairs, const int R, __m512 acc[][2],
                     const char *pf, int64_t pf_lines, const int once) {
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t owed = 0;
    for (int64_t j = 0; j < pairs; j++) {
        if (once) {
            _mm_prefetch((const char *)(pw + (j + PREFETCH) * 32), _MM_HINT_NTA);
            _mm_prefetch((const char *)(pw + (j + PREFETCH) * 32 + 16), _MM_HINT_NTA);
        } else {
            _mm_prefetch((const char *)(pw + (j + PREFETCH) * 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(pw + (j + PREFETCH) * 32 + 16), _MM_HINT_T0);
        }
        for (owed += pf_lines; owed >= pairs; owed -= pairs, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pw + j * 32);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pw + j * 32 + 16);
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[r][j]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
}

/* Rows of the next of `tiles` tiles over `rows` rows: as even as they go (17 rows: 6, 6, 5 rather
 * than 8, 8, 1; a tile of few rows waits on its few accumulators' latency about as long as a full
 * one computes). */
static inline int tile_rows(int64_t rows, int64_t tiles) { return (int)((rows + tiles - 1) / tiles); }

/* Streaming: a panel of n row tiles is read from memory by its first tile and from cache by the
 * others, so memory would sit idle during those. Instead each of the n tiles of a panel prefetches
 * 1/n of the panel the thread takes next (`next`, NULL at the end of its items): the reads go on
 * at an even pace through all the tiles. A panel of one tile streams by itself (its own prefetch
 * ahead); asking for the next one too measured 5% slower at 1-16 tokens. `always`: a panel of one
 * tile prefetches the next one too (the AMX kernel, whose tiles do not prefetch their own panel).
 * Tile i of n: its first line and (out) how many lines. */
static inline const char *tile_prefetch(const uint32_t *next, int64_t pairs, int64_t i, int64_t n, int64_t *lines,
                                        int always) {
    const int64_t total = next && (n > 1 || always) ? pairs * 2 : 0; /* 128 bytes per pair of a 32-output panel */
    const int64_t first = total * i / n;
    *lines = total * (i + 1) / n - first;
    return (const char *)next + 64 * first;
}

/* h[c0..c0+15] = bf16(bf16(silu(g)) * u) for one row's float32 gate and up sums, g = min(bf16(gate), limit),
 * u = clamp(bf16(up), -limit, limit) (DeepSeek-V4's swiglu_limit; limit INFINITY: plain SiLU-mul). */
AI512 void up_store(__m512 gate, __m512 up, uint16_t *h, float limit) {
    const __m512 lim = _mm512_set1_ps(limit);
    const __m512 g = _mm512_min_ps(bf16_round(gate), lim);
    const __m512 u = _mm512_max_ps(_mm512_min_ps(bf16_round(up), lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
    const __m512 s = bf16_round(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    _mm256_storeu_si256((__m256i *)h, round16(_mm512_mul_ps(s, u)));
}

/* o[0..n) = bf16(o + bf16(w * bf16(sum))) for one row's float32 sums of 32 outputs (masks m0, m1). */
AI512 void down_store(__m512 sum0, __m512 sum1, float w, uint16_t *o, __mmask16 m0, __mmask16 m1) {
    const __m512 wv = _mm512_set1_ps(w);
    const __m512 v0 = bf16_round(_mm512_mul_ps(bf16_round(sum0), wv));
    const __m512 v1 = bf16_round(_mm512_mul_ps(bf16_round(sum1), wv));
    const __m512 s0 = _mm512_add_ps(widen16(_mm256_maskz_loadu_epi16(m0, o)), v0);
    const __m512 s1 = _mm512_add_ps(widen16(_mm256_maskz_loadu_epi16(m1, o + 16)), v1);
    _mm256_mask_storeu_epi16(o, m0, round16(s0));
    _mm256_mask_storeu_epi16(o + 16, m1, round16(s1));
}

/* h rows (ldh apart) from R rows' gate/up panel. */
AI512 void up_tile(const uint32_t *const *xr, const uint32_t *pw, int64_t pairs, uint16_t *h, int64_t ldh,
                   const char *pf, int64_t pf_lines, const int R, float limit, int once) {
    __m512 acc[MAX_R][2];
    panel_dot(xr, pw, pairs, R, acc, pf, pf_lines, once);
    for (int r = 0; r < R; r++) up_store(acc[r][0], acc[r][1], h + r * ldh, limit);
}

/* out[tok[r]][o0..o0+n) += the weighted down projection of R rows. */
AI512 void down_tile(const uint32_t *const *hr, const uint32_t *pw, int64_t pairs, const int64_t *tok,
                     const float *wgt, uint16_t *out, int64_t D, int64_t o0, __mmask16 m0, __mmask16 m1,
                     const char *pf, int64_t pf_lines, const int R, int once) {
    __m512 acc[MAX_R][2];
    panel_dot(hr, pw, pairs, R, acc, pf, pf_lines, once);
    for (int r = 0; r < R; r++) down_store(acc[r][0], acc[r][1], wgt[r], out + tok[r] * D + o0, m0, m1);
}

/* The AMX kernels (amx_bf16.c) on the same panels: c = 16 or 32 rows times one panel. */
void shuttle_amx_begin(void);
void shuttle_amx_end(void);
void shuttle_amx_panel(const uint16_t *a, int64_t lda_bytes, const uint32_t *pw, int64_t pairs, int two, int valid,
                       float *c, const char *pf, int64_t pf_lines);
int shuttle_use_amx(int op, int64_t rows);
#define OP_GEMM 0
#define OP_MOE 1

/* A buffer of `rows` x `cols` bf16 values, 64-byte aligned, or NULL. */
static uint16_t *bf16_buffer(int64_t rows, int64_t cols) {
    const size_t bytes = ((size_t)(rows * cols) * 2 + 63) / 64 * 64;
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* masks of the valid outputs among a panel's 32 (o0: its first output of O) */
static inline void panel_masks(int64_t O, int64_t o0, __mmask16 *m0, __mmask16 *m1) {
    const int64_t nv = O - o0 < 32 ? O - o0 : 32;
    *m0 = nv >= 16 ? 0xFFFF : (__mmask16)((1u << nv) - 1);
    *m1 = nv >= 32 ? 0xFFFF : nv <= 16 ? 0 : (__mmask16)((1u << (nv - 16)) - 1);
}

/* shuttle_gemm_bf16_panels with AMX tiles: blocks of rows that fit half a MiB (their x stays in L2
 * while each thread's panels stream through), threads owning ranges of panels as below. x is copied
 * to a buffer padded to 32 rows unless T is a multiple of 32 already. Returns -1 if that copy cannot
 * be allocated. */
T512 static int gemm_panels_amx(const uint16_t *x, int64_t T, int64_t I, const uint16_t *panels, int64_t O,
                                uint16_t *y, int nthreads) {
    const int64_t P = (O + 31) / 32, pairs = I / 2, Tp = (T + 31) / 32 * 32;
    uint16_t *pad = NULL;
    if (Tp != T) {
        if (!(pad = bf16_buffer(Tp, I))) return -1;
        memcpy(pad, x, (size_t)(T * I) * 2);
        memset(pad + T * I, 0, (size_t)((Tp - T) * I) * 2);
    }
    const uint16_t *a = pad ? pad : x;
    int64_t block = (1 << 19) / (I * 2) / 32 * 32;
    block = block < 32 ? 32 : block;
    if (nthreads > P) nthreads = (int)P;
    #pragma omp parallel num_threads(nthreads)
    {
        float c[32 * 32] __attribute__((aligned(64)));
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = P * th / nt, hi = P * (th + 1) / nt;
        shuttle_amx_begin();
        for (int64_t t0 = 0; t0 < T; t0 += block)
            for (int64_t p = lo; p < hi; p++) {
                const uint32_t *pw = (const uint32_t *)panels + p * pairs * 32;
                const uint32_t *pnext = p + 1 < hi ? pw + pairs * 32 : NULL;
                __mmask16 m0, m1;
                panel_masks(O, p * 32, &m0, &m1);
                const int64_t t1 = T < t0 + block ? T : t0 + block, blocks = (t1 - t0 + 31) / 32;
                for (int64_t t = t0, bi = 0; t < t1; t += 32, bi++) {
                    const int n = T - t < 32 ? (int)(T - t) : 32;
                    int64_t pf_lines;
                    const char *pf = tile_prefetch(pnext, pairs, bi, blocks, &pf_lines, 1);
                    shuttle_amx_panel(a + t * I, I * 2, pw, pairs, n > 16, n, c, pf, pf_lines);
                    for (int r = 0; r < n; r++) {
                        _mm256_mask_storeu_epi16(y + (t + r) * O + p * 32, m0, round16(_mm512_load_ps(c + r * 32)));
                        _mm256_mask_storeu_epi16(y + (t + r) * O + p * 32 + 16, m1, round16(_mm512_load_ps(c + r * 32 + 16)));
                    }
                }
            }
        shuttle_amx_end();
    }
    free(pad);
    return 0;
}

/* y (T, O) = x (T, I) W^T for one dense weight in the same panels (kernels/cpu_linear.CpuWeight on such
 * a CPU: the q/k/v, o and LM-head projections), bf16 in and out, I even. Each thread owns a range of
 * panels within blocks of ROW_BLOCK rows (their x rows stay in L2 while each panel's weights stream
 * once, the next panel prefetched by the row tiles after the first). */
T512 void shuttle_gemm_bf16_panels(const uint16_t *x, int64_t T, int64_t I, const uint16_t *panels, int64_t O,
                                   uint16_t *y, int nthreads) {
    const int64_t P = (O + 31) / 32, pairs = I / 2;
    if (P == 0 || T == 0) return;
    if (shuttle_use_amx(OP_GEMM, T) && gemm_panels_amx(x, T, I, panels, O, y, nthreads) == 0) return;
    /* no more threads than panels (a router's 8 outputs are one), and under passive waits one
     * thread for under 8M multiply-adds (~35 us of a core): its share is less than waking a thread */
    if (nthreads > P) nthreads = (int)P;
    if (passive_waits() && T * O * I < (1 << 23)) nthreads = 1;
    for (int64_t t0 = 0; t0 < T; t0 += ROW_BLOCK) {
        const int64_t t1 = T - t0 < ROW_BLOCK ? T : t0 + ROW_BLOCK;
        #pragma omp parallel num_threads(nthreads)
        {
            const int th = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t hi = P * (th + 1) / nt;
            for (int64_t p = P * th / nt; p < hi; p++) {
                const uint32_t *pw = (const uint32_t *)panels + p * pairs * 32, *rows[MAX_R];
                const uint32_t *pnext = p + 1 < hi ? pw + pairs * 32 : NULL;
                const int64_t o0 = p * 32, nv = O - o0 < 32 ? O - o0 : 32;
                const __mmask16 m0 = nv >= 16 ? 0xFFFF : (__mmask16)((1u << nv) - 1);
                const __mmask16 m1 = nv >= 32 ? 0xFFFF : nv <= 16 ? 0 : (__mmask16)((1u << (nv - 16)) - 1);
                const int64_t tiles = (t1 - t0 + MAX_R - 1) / MAX_R;
                for (int64_t t = t0, ti = 0, n; t < t1; t += n, ti++) {
                    n = tile_rows(t1 - t, tiles - ti);
                    for (int i = 0; i < n; i++) rows[i] = (const uint32_t *)(x + (t + i) * I);
                    int64_t pf_lines;
                    const char *pf = tile_prefetch(pnext, pairs, ti, tiles, &pf_lines, 0);
                    __m512 acc[MAX_R][2];
#define DOT(R) panel_dot(rows, pw, pairs, R, acc, pf, pf_lines, 0)
                    BY_ROWS(n, DOT)
#undef DOT
                    for (int r = 0; r < n; r++) {
                        _mm256_mask_storeu_epi16(y + (t + r) * O + o0, m0, round16(acc[r][0]));
                        _mm256_mask_storeu_epi16(y + (t + r) * O + o0 + 16, m1, round16(acc[r][1]));
                    }
                }
            }
        }
    }
}

/* x (T, D) bf16, D even; ids (T, K) int64; wk (T, K) float32; w13[e] / w2[e]: the panels of expert e
 * (I16 / 16 panels over D / 2 pairs; ceil(D / 32) panels over I16 / 2 pairs); out (T, D) bf16, zeroed;
 * scratch: (T * K, I16) bf16; limit: the SwiGLU clamp (up_store; INFINITY for none). Returns 0, or -1 if
 * memory ran out (out is then unchanged). */
T512 int shuttle_fused_moe_bf16(const uint16_t *x, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                                int64_t K, const int64_t *w13, const int64_t *w2, int64_t E, int64_t I16,
                                uint16_t *scratch, uint16_t *out, float limit, int nthreads) {
    const int64_t N = T * K, P13 = I16 / 16, P2 = (D + 31) / 32, xpairs = D / 2, hpairs = I16 / 2;
    int64_t *count = calloc(E + 1, sizeof(int64_t)), *tok = malloc(sizeof(int64_t) * (N + 1));
    float *wgt = malloc(sizeof(float) * (N + 1));
    int64_t *items = NULL;
    char *amx_e = calloc(E + 1, 1);
    uint16_t *xg = NULL, *hs = NULL;
    if (!count || !tok || !wgt || !amx_e) goto fail;
    for (int64_t n = 0; n < N; n++)
        if (ids[n] >= 0 && ids[n] < E) count[ids[n] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e]; /* count[e]: expert e's first row */
    int64_t nitems = 0;
    /* Experts whose rows the choice table gives to AMX read their x rows from a gathered copy (xg,
     * sorted as the pairs) and write h to hs: both with 32 spare rows, so that a partial block of
     * tiles reads inside them. */
    int64_t amx_rows = 0;
    for (int64_t e = 0; e < E; e++) amx_e[e] = shuttle_use_amx(OP_MOE, count[e + 1] - count[e]), amx_rows += amx_e[e] ? count[e + 1] - count[e] : 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t block = amx_e[e] ? AMX_ROW_BLOCK : ROW_BLOCK;
        nitems += (count[e + 1] - count[e] + block - 1) / block * P13;
    }
    items = malloc(sizeof(int64_t) * 3 * (nitems + 1));
    if (!items) goto fail;
    {
        int64_t *fill = malloc(sizeof(int64_t) * (E + 1));
        if (!fill) goto fail;
        for (int64_t e = 0; e < E; e++) fill[e] = count[e];
        for (int64_t n = 0; n < N; n++) /* stable: pairs of one expert keep token order */
            if (ids[n] >= 0 && ids[n] < E) {
                const int64_t i = fill[ids[n]]++;
                tok[i] = n / K;
                wgt[i] = wk[n];
            }
        free(fill);
    }
    {
        int64_t it = 0;
        for (int64_t e = 0; e < E; e++)
            for (int64_t r0 = count[e]; r0 < count[e + 1]; r0 += amx_e[e] ? AMX_ROW_BLOCK : ROW_BLOCK)
                for (int64_t p = 0; p < P13; p++, it++) items[3 * it] = e, items[3 * it + 1] = r0, items[3 * it + 2] = p;
    }
    if (amx_rows) {
        xg = bf16_buffer(N + 32, D), hs = bf16_buffer(N + 32, I16);
        if (!xg || !hs) goto fail;
        memset(xg + N * D, 0, (size_t)(32 * D) * 2);
        memset(hs + N * I16, 0, (size_t)(32 * I16) * 2);
        scratch = hs;
    }
    /* Up items are handed out through this counter in chunks of UP_CHUNK, or fewer where there are
     * too few items for two chunks a thread: a batch-1 expert's 40 items (I = 320) went 32 to one thread
     * and 8 to the other (the built-in model's MoE blocks took 11-24% less time at batch 1 split evenly). */
    int64_t taken = 0, chunk = (nitems + 2 * nthreads - 1) / (2 * nthreads);
    chunk = chunk < 1 ? 1 : chunk > UP_CHUNK ? UP_CHUNK : chunk;
    int64_t arrived = 0, gathered = 0; /* threads done with the up phase / the gather (spin_barrier) */
    #pragma omp parallel num_threads(nthreads)
    {
        const uint32_t *rows[MAX_R];
        float c[32 * 32] __attribute__((aligned(64)));
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (amx_rows) {
            shuttle_amx_begin();
            for (int64_t e = 0; e < E; e++) /* this thread's share of every AMX expert's rows */
                if (amx_e[e]) {
                    const int64_t n0 = count[e], n = count[e + 1] - n0;
                    for (int64_t r = n0 + n * t / nt; r < n0 + n * (t + 1) / nt; r++) memcpy(xg + r * D, x + tok[r] * D, (size_t)D * 2);
                }
            spin_barrier(&gathered, nt);
        }
        /* Up: each thread claims its next chunk one item early, so that it always knows the panel it
         * takes next (tile_prefetch) and the chunks still balance experts of unequal rows. */
        int64_t it = chunk * __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED), end = it + chunk;
        while (it < nitems) {
            int64_t next = it + 1;
            if (next >= end || next >= nitems) next = chunk * __atomic_fetch_add(&taken, 1, __ATOMIC_RELAXED), end = next + chunk;
            const int64_t e = items[3 * it], r0 = items[3 * it + 1], p = items[3 * it + 2];
            const int64_t block = amx_e[e] ? AMX_ROW_BLOCK : ROW_BLOCK;
            const int64_t r1 = count[e + 1] - r0 < block ? count[e + 1] : r0 + block;
            const uint32_t *pw = (const uint32_t *)(uintptr_t)w13[e] + p * xpairs * 32;
            const uint32_t *pnext = next < nitems ? (const uint32_t *)(uintptr_t)w13[items[3 * next]] + items[3 * next + 2] * xpairs * 32 : NULL;
            if (amx_e[e]) {
                const int64_t blocks = (r1 - r0 + 31) / 32;
                for (int64_t r = r0, bi = 0; r < r1; r += 32, bi++) {
                    const int n = r1 - r < 32 ? (int)(r1 - r) : 32;
                    int64_t pf_lines;
                    const char *pf = tile_prefetch(pnext, xpairs, bi, blocks, &pf_lines, 1);
                    shuttle_amx_panel(xg + r * D, D * 2, pw, xpairs, n > 16, n, c, pf, pf_lines);
                    for (int i = 0; i < n; i++) up_store(_mm512_load_ps(c + i * 32), _mm512_load_ps(c + i * 32 + 16), scratch + (r + i) * I16 + p * 16, limit);
                }
                it = next;
                continue;
            }
            const int64_t tiles = (r1 - r0 + MAX_R - 1) / MAX_R;
            for (int64_t r = r0, ti = 0, n; r < r1; r += n, ti++) {
                n = tile_rows(r1 - r, tiles - ti);
                for (int i = 0; i < n; i++) rows[i] = (const uint32_t *)(x + tok[r + i] * D);
                uint16_t *h = scratch + r * I16 + p * 16;
                int64_t pf_lines;
                const char *pf = tile_prefetch(pnext, xpairs, ti, tiles, &pf_lines, 0);
#define UP(R) up_tile(rows, pw, xpairs, h, I16, pf, pf_lines, R, limit, tiles == 1)
                BY_ROWS(n, UP)
#undef UP
            }
            it = next;
        }
        spin_barrier(&arrived, nt);
        /* Down: thread t owns output panels [lo, hi) and walks every expert with rows in each. */
        const int64_t lo = P2 * t / nt, hi = P2 * (t + 1) / nt;
        for (int64_t p = lo; p < hi; p++) {
            const int64_t o0 = p * 32;
            __mmask16 m0, m1;
            panel_masks(D, o0, &m0, &m1);
            for (int64_t e = 0; e < E; e++) {
                if (count[e + 1] == count[e]) continue;
                const uint32_t *pw = (const uint32_t *)(uintptr_t)w2[e] + p * hpairs * 32, *pnext = NULL;
                for (int64_t np = p, ne = e + 1; np < hi && !pnext; np++, ne = 0) /* the next (panel, expert) */
                    for (; ne < E; ne++)
                        if (count[ne + 1] > count[ne]) {
                            pnext = (const uint32_t *)(uintptr_t)w2[ne] + np * hpairs * 32;
                            break;
                        }
                if (amx_e[e]) {
                    const int64_t blocks = (count[e + 1] - count[e] + 31) / 32;
                    for (int64_t r = count[e], bi = 0; r < count[e + 1]; r += 32, bi++) {
                        const int n = count[e + 1] - r < 32 ? (int)(count[e + 1] - r) : 32;
                        int64_t pf_lines;
                        const char *pf = tile_prefetch(pnext, hpairs, bi, blocks, &pf_lines, 1);
                        shuttle_amx_panel(scratch + r * I16, I16 * 2, pw, hpairs, n > 16, n, c, pf, pf_lines);
                        for (int i = 0; i < n; i++)
                            down_store(_mm512_load_ps(c + i * 32), _mm512_load_ps(c + i * 32 + 16), wgt[r + i], out + tok[r + i] * D + o0, m0, m1);
                    }
                    continue;
                }
                const int64_t tiles = (count[e + 1] - count[e] + MAX_R - 1) / MAX_R;
                for (int64_t r = count[e], ti = 0, n; r < count[e + 1]; r += n, ti++) {
                    n = tile_rows(count[e + 1] - r, tiles - ti);
                    for (int i = 0; i < n; i++) rows[i] = (const uint32_t *)(scratch + (r + i) * I16);
                    int64_t pf_lines;
                    const char *pf = tile_prefetch(pnext, hpairs, ti, tiles, &pf_lines, 0);
#define DOWN(R) down_tile(rows, pw, hpairs, tok + r, wgt + r, out, D, o0, m0, m1, pf, pf_lines, R, tiles == 1)
                    BY_ROWS(n, DOWN)
#undef DOWN
                }
            }
        }
        if (amx_rows) shuttle_amx_end();
    }
    free(items), free(count), free(tok), free(wgt), free(amx_e), free(xg), free(hs);
    return 0;
fail:
    free(items), free(count), free(tok), free(wgt), free(amx_e), free(xg), free(hs);
    return -1;
}
#else
int shuttle_avx512bf16_built(void) { return 0; }
int shuttle_fused_moe_bf16(void) { return -2; }
void shuttle_gemm_bf16_panels(void) {}
#endif
