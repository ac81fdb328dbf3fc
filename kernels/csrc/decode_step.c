/* A whole bf16 decode step's layers in one call, for the CPU: what a captured graph replays on a
 * GPU. At batch 1 the eager step spent ~1 ms of its ~6 (425M shapes, AVX-512 EPYC) between the
 * kernels: each layer's ~10 native calls and ~30 torch ops, each with its Python, its argument
 * checks and its allocation. Here the same kernels run in the same order on buffers the caller
 * allocated once, so the only work left between them is the routing below and two row copies.
 *
 * Per layer (models/native_decode.py builds the tables and decides which models qualify):
 *   h, r   = add_rms_norm(x, r)              (layer 0: h = rms_norm(x), r = x; r in place)
 *   qkv    = h W_qkv^T                       (bf16 panels, or int8 / FP8 ones: the layer's qkv_s set)
 *   q, k   = q/k norm (per head or over the whole projection, where the model has it), then rotary
 *   cache  <- k, v at each token's slot      (index_copy_ of the eager path)
 *   o      = paged decode attention (q copied to (B, N, H) rows first, as .contiguous() does)
 *   a      = o W_o^T                         (as W_qkv)
 *   h, r   = add_rms_norm(a, r)
 *   logits = h W_router^T                    (bf16, as the eager router's panels give them)
 *   ids, w = softmax, top-k, renormalise, scale, (round to bf16)   (route() below)
 *   x      = fused_moe_bf16(h, ids, w)        (int8 / FP8 / MXFP4 experts: fused_moe_int8 / _fp8 / _mxfp4)
 * and at the end y, r = add_rms_norm(x, r) with the final norm (r: its input, the last layer's output, which an
 * MTP layer's chained drafts take). An attention worker, whose experts are
 * remote, calls the attention side of one layer at a time (shuttle_decode_attention) and sends h,
 * the ids and the weights through M2N in between.
 *
 * The eager path calls the same kernels with the same arguments, so the two give the same bits
 * (tests/test_native_decode.py). */
#include "bf16_avx2.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

void shuttle_add_rms_norm(const void *x, const void *residual, const void *weight, void *y, void *r_out, int64_t T,
                          int64_t D, float eps, int bf16, int nthreads);
void shuttle_rotary(void *q, int64_t NQ, int64_t q_tok, int64_t q_head, void *k, int64_t NK, int64_t k_tok,
                    int64_t k_head, const void *cos, const void *sin, int64_t T, int64_t R, int bf16, int nthreads);
void shuttle_paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, int bf16,
                                    const int64_t *table, int64_t M, const int64_t *start, const int64_t *len, void *o,
                                    float *lse, int64_t B, int64_t K, int64_t G, int64_t H, int64_t V, int64_t S,
                                    int64_t k_page, int64_t k_slot, int64_t k_head, int64_t v_page, int64_t v_slot,
                                    int64_t v_head, float scale, int nthreads, int q_bf16, int o_bf16, int allow_wide);

/* One layer's weights and cache (pointers stay valid while the model lives). Only pointers, int64
 * and double fields, so the ctypes mirror (models/native_decode.py: _Layer) has no padding to match. */
typedef struct {
    const void *in_norm, *post_norm;  /* (D) bf16 */
    const void *qkv, *o, *router;     /* panels (kernels/native.pack_panels32) */
    const void *q_norm, *k_norm;      /* (H) or (Q) / (C) bf16, or NULL */
    const int64_t *w13, *w2;          /* the experts' panel pointers, (E) */
    void *k_cache, *v_cache;          /* (P, S, K, H) bf16, contiguous */
    int64_t window;                   /* sliding window, 0: none */
    const int64_t *s13, *s2;          /* int8 or FP8 experts: their scales' pointers, (E) (w13, w2: their codes'); */
                                      /* NULL: bf16 experts on panels */
    const float *qkv_s, *o_s;         /* int8 or FP8 q/k/v and o: their scales (qkv, o: their codes' panels); */
                                      /* NULL: bf16 panels */
    const int64_t *b13, *b2;          /* MXFP4 experts: their float32 biases' pointers, (E), or NULL */
} shuttle_layer;

/* The step: shapes, constants, this step's inputs and the buffers the layers pass along. */
typedef struct {
    int64_t B, D, N, K, H, R, E, top_k, I16, S, M, qk_norm; /* qk_norm: 0 none, 1 per head, 2 full */
    int64_t renormalize, weights_bf16, threads;
    double eps, qk_eps, scale, scaling;
    const void *final_norm;                       /* (D) bf16 */
    const void *x;                                /* (B, D) bf16: the embeddings */
    const void *cos, *sin;                        /* (B, R) bf16 */
    const int64_t *slots, *table, *len;           /* (B), (B, M), (B) */
    int64_t *start;                               /* (B) scratch */
    void *h, *r, *qkv, *q, *o, *a, *logits;       /* (B, D) x2, (B, Q + 2C), (B, Q) x2, (B, D), (B, E) bf16 */
    void *moe, *scratch, *y;                      /* (B, D), (B top_k, I16), (B, D) bf16 */
    float *lse, *wk;                              /* (B, N), (L, B, top_k) */
    int64_t *ids;                                 /* (L, B, top_k): every layer's choice (load counts, M2N) */
    int64_t inter, int8_kernel, int8_big_kernel, int8_big_rows, int8_vnni_rows; /* int8 / FP8 experts: the fused */
                                                                                /* block's arguments */
    int64_t fp8_bpairs13, fp8_bpairs2; /* FP8 experts: input pairs per scale block of w13 and w2; 0: int8 experts */
    int64_t linear_kernel, linear_bpairs; /* int8 / FP8 q/k/v and o: the kernel at B rows (int8_linear's default); */
                                          /* FP8: input pairs per scale block, 0: int8 */
    int64_t mxfp4, mx_kernel;             /* MXFP4 experts (the layers' s13 set): 1, and fused_moe_mxfp4's kernel */
    double mx_alpha, mx_limit, mx_offset; /* their activation (kernels/moe.SwiGLU; limit INFINITY: none) */
    const uint8_t *mx_rows;               /* per row bucket 1 where bf16 rows take BF16DOT */
} shuttle_step;

/* Softmax over the E logits in float32 (bf16 or float32 logits), the K largest probabilities (ties:
 * the lowest id), gathered, renormalised and scaled: kernels/routing.topk_route's softmax routing,
 * which both paths call (kernels/routing.py sends it here on the CPU), so they agree to the bit. */
static void route(const void *logits, int logits_bf16, int64_t E, int64_t K, int renorm, float scaling,
                  int weights_bf16, int64_t *ids, float *wk) {
    float p[E];
    float m = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        p[e] = logits_bf16 ? bf16_to_f32(((const uint16_t *)logits)[e]) : ((const float *)logits)[e];
        m = p[e] > m ? p[e] : m;
    }
    for (int64_t e = 0; e < E; e++) p[e] = expf(p[e] - m), sum += p[e];
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; e++) p[e] *= inv;
    /* The K largest in descending order, ties by the lowest id (as K rounds of selection would take
     * them), in one pass: each probability above the K-th kept so far is inserted in order, an equal
     * one after the ones it equals. (Selection took O(E K^2): slower than torch's top-k from 3 rows
     * of 64 experts, top 8; kernels/choice.py times the two.) */
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        if (n == K && !(p[e] > wk[K - 1]))
            continue;
        int64_t j = n < K ? n++ : K - 1;
        for (; j > 0 && p[e] > wk[j - 1]; j--)
            wk[j] = wk[j - 1], ids[j] = ids[j - 1];
        wk[j] = p[e], ids[j] = e;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < K; j++) total += wk[j];
    for (int64_t j = 0; j < K; j++) {
        float w = renorm ? wk[j] / total : wk[j];
        if (scaling != 1.0f) w *= scaling;
        wk[j] = weights_bf16 ? rbf(w) : w;
    }
}

/* route() for T rows of logits (T, E): ids (T, K) int64, weights (T, K) float32. */
void shuttle_route_softmax_topk(const void *logits, int logits_bf16, int64_t T, int64_t E, int64_t K, int renorm,
                                float scaling, int64_t *ids, float *wk) {
    for (int64_t t = 0; t < T; t++)
        route((const char *)logits + t * E * (logits_bf16 ? 2 : 4), logits_bf16, E, K, renorm, scaling, 0, ids + t * K,
              wk + t * K);
}

#if defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10
void shuttle_gemm_bf16_panels(const uint16_t *x, int64_t T, int64_t I, const uint16_t *panels, int64_t O,
                              uint16_t *y, int nthreads);
int shuttle_fused_moe_bf16(const uint16_t *x, int64_t T, int64_t D, const int64_t *ids, const float *wk, int64_t K,
                           const int64_t *w13, const int64_t *w2, int64_t E, int64_t I16, uint16_t *scratch,
                           uint16_t *out, float limit, int nthreads);
int shuttle_fused_moe_int8(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                           int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                           int64_t E, int64_t I, void *y, int nthreads, int kernel, int big_kernel, int64_t big_rows,
                           int64_t vnni_rows);
int shuttle_fused_moe_fp8(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                          int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                          int64_t E, int64_t I, int64_t bpairs13, int64_t bpairs2, void *y, int nthreads, int kernel,
                          int big_kernel, int64_t big_rows);
int shuttle_int8_linear(const void *x, int x_bf16, int64_t T, int64_t I, const int8_t *panels, const float *scales,
                        const float *bias, int64_t O, void *y, int y_bf16, int nthreads, int kernel);
int shuttle_fused_moe_mxfp4(const void *x, int x_bf16, int64_t T, int64_t D, const int64_t *ids, const float *wk,
                            int64_t K, const int64_t *w13, const int64_t *s13, const int64_t *w2, const int64_t *s2,
                            const int64_t *b13, const int64_t *b2, int64_t E, int64_t I, float alpha, float limit,
                            float up_offset, void *y, int nthreads, int kernel, const uint8_t *bf16dot_rows);
int shuttle_fp8_linear(const void *x, int x_bf16, int64_t T, int64_t I, const uint8_t *panels, const float *scales,
                       int64_t bpairs, const float *bias, int64_t O, void *y, int y_bf16, int nthreads, int kernel);

/* y (B, O) = x (B, I) W^T, all bf16: W on bf16 panels (scales NULL), else int8 or FP8 panels with
 * their scales, as kernels/cpu_linear.cpu_linear runs each. Returns the int8 / FP8 kernel's error. */
static int linear(const shuttle_step *s, const void *w, const float *scales, const void *x, int64_t I, int64_t O,
                  void *y) {
    const int nt = (int)s->threads, kernel = (int)s->linear_kernel;
    if (!scales) {
        shuttle_gemm_bf16_panels(x, s->B, I, w, O, y, nt);
        return 0;
    }
    return s->linear_bpairs
               ? shuttle_fp8_linear(x, 1, s->B, I, w, scales, s->linear_bpairs, NULL, O, y, 1, nt, kernel)
               : shuttle_int8_linear(x, 1, s->B, I, w, scales, NULL, O, y, 1, nt, kernel);
}

/* Layer l's attention side for the step's B tokens: from x (the embeddings at layer 0, else the
 * previous layer's combined MoE output) to the MoE's input s->h and the router's choice (layer l's
 * rows of s->ids and s->wk). The residual stream s->r is updated in place (add_rms_norm reads a
 * row whole before it writes it). Called alone by an attention worker, whose experts are elsewhere,
 * between its M2N dispatches; shuttle_decode_step calls it before each layer's MoE block. Returns 0, or
 * an int8 / FP8 linear's error (-1: out of memory, -2: its kernel cannot run; the layer is unfinished). */
int shuttle_decode_attention(const shuttle_step *s, const shuttle_layer *ly, int64_t l, const void *x) {
    const int64_t B = s->B, D = s->D, N = s->N, K = s->K, H = s->H, Q = N * H, C = K * H, W = Q + 2 * C;
    const int nt = (int)s->threads;
    const float eps = (float)s->eps, qk_eps = (float)s->qk_eps;
    uint16_t *qkv = s->qkv, *q = s->q;
    if (l == 0) { /* no residual yet: r = x */
        shuttle_add_rms_norm(x, NULL, ly->in_norm, s->h, NULL, B, D, eps, 1, nt);
        memcpy(s->r, x, (size_t)(B * D) * 2);
    } else {
        shuttle_add_rms_norm(x, s->r, ly->in_norm, s->h, s->r, B, D, eps, 1, nt);
    }
    int rc = linear(s, ly->qkv, ly->qkv_s, s->h, D, W, qkv);
    if (rc)
        return rc;
    if (s->qk_norm == 1) /* each head's H values, in place */
        for (int64_t b = 0; b < B; b++) {
            shuttle_add_rms_norm(qkv + b * W, NULL, ly->q_norm, qkv + b * W, NULL, N, H, qk_eps, 1, 1);
            shuttle_add_rms_norm(qkv + b * W + Q, NULL, ly->k_norm, qkv + b * W + Q, NULL, K, H, qk_eps, 1, 1);
        }
    else if (s->qk_norm == 2) /* the whole projection */
        for (int64_t b = 0; b < B; b++) {
            shuttle_add_rms_norm(qkv + b * W, NULL, ly->q_norm, qkv + b * W, NULL, 1, Q, qk_eps, 1, 1);
            shuttle_add_rms_norm(qkv + b * W + Q, NULL, ly->k_norm, qkv + b * W + Q, NULL, 1, C, qk_eps, 1, 1);
        }
    shuttle_rotary(qkv, N, W, H, qkv + Q, K, W, H, s->cos, s->sin, B, s->R, 1, nt);
    for (int64_t b = 0; b < B; b++) {
        memcpy((uint16_t *)ly->k_cache + s->slots[b] * C, qkv + b * W + Q, (size_t)C * 2);
        memcpy((uint16_t *)ly->v_cache + s->slots[b] * C, qkv + b * W + Q + C, (size_t)C * 2);
        memcpy(q + b * Q, qkv + b * W, (size_t)Q * 2);
        s->start[b] = ly->window && s->len[b] > ly->window ? s->len[b] - ly->window : 0;
    }
    shuttle_paged_decode_attention(q, ly->k_cache, ly->v_cache, 1, s->table, s->M, s->start, s->len, s->o, s->lse, B,
                                   K, N / K, H, H, s->S, s->S * C, C, H, s->S * C, C, H, (float)s->scale, nt, 1, 1, 1);
    if ((rc = linear(s, ly->o, ly->o_s, s->o, Q, D, s->a)))
        return rc;
    shuttle_add_rms_norm(s->a, s->r, ly->post_norm, s->h, s->r, B, D, eps, 1, nt);
    shuttle_gemm_bf16_panels(s->h, B, D, ly->router, s->E, s->logits, nt);
    int64_t *ids = s->ids + l * B * s->top_k;
    float *wk = s->wk + l * B * s->top_k;
    for (int64_t b = 0; b < B; b++)
        route((const uint16_t *)s->logits + b * s->E, 1, s->E, s->top_k, (int)s->renormalize, (float)s->scaling,
              (int)s->weights_bf16, ids + b * s->top_k, wk + b * s->top_k);
    return 0;
}

/* The whole step, experts in this process (bf16 on panels, or int8 / FP8 / MXFP4: the layer's s13 set, FP8
 * where s->fp8_bpairs13 is, MXFP4 where s->mxfp4 is). Returns 0,
 * or the error of a layer's int8 / FP8 linears or MoE block (-1: out of memory, -2: its kernel cannot run;
 * nothing after it ran). */
int shuttle_decode_step(const shuttle_step *s, const shuttle_layer *layers, int64_t L) {
    const int64_t B = s->B, D = s->D, BK = s->B * s->top_k;
    for (int64_t l = 0; l < L; l++) {
        const shuttle_layer *ly = &layers[l];
        int rc = shuttle_decode_attention(s, ly, l, l ? s->moe : s->x);
        if (rc)
            return rc;
        memset(s->moe, 0, (size_t)(B * D) * 2);
        rc = ly->s13 && s->mxfp4
                 ? shuttle_fused_moe_mxfp4(s->h, 1, B, D, s->ids + l * BK, s->wk + l * BK, s->top_k, ly->w13, ly->s13,
                                           ly->w2, ly->s2, ly->b13, ly->b2, s->E, s->inter, (float)s->mx_alpha,
                                           (float)s->mx_limit, (float)s->mx_offset, s->moe, (int)s->threads,
                                           (int)s->mx_kernel, s->mx_rows)
             : ly->s13 && s->fp8_bpairs13
                     ? shuttle_fused_moe_fp8(s->h, 1, B, D, s->ids + l * BK, s->wk + l * BK, s->top_k, ly->w13, ly->s13,
                                             ly->w2, ly->s2, s->E, s->inter, s->fp8_bpairs13, s->fp8_bpairs2, s->moe,
                                             (int)s->threads, (int)s->int8_kernel, (int)s->int8_big_kernel,
                                             s->int8_big_rows)
                 : ly->s13 ? shuttle_fused_moe_int8(s->h, 1, B, D, s->ids + l * BK, s->wk + l * BK, s->top_k, ly->w13,
                                                  ly->s13, ly->w2, ly->s2, s->E, s->inter, s->moe, (int)s->threads,
                                                  (int)s->int8_kernel, (int)s->int8_big_kernel, s->int8_big_rows,
                                                  s->int8_vnni_rows)
                         : shuttle_fused_moe_bf16(s->h, B, D, s->ids + l * BK, s->wk + l * BK, s->top_k, ly->w13,
                                                  ly->w2, s->E, s->I16, s->scratch, s->moe, INFINITY, (int)s->threads);
        if (rc)
            return rc;
    }
    shuttle_add_rms_norm(s->moe, s->r, s->final_norm, s->y, s->r, B, D, (float)s->eps, 1, (int)s->threads);
    return 0;
}

/* An MTP layer's drafts (models/mtp.MTPDrafter.native_drafts): passes of the layer alone (layers[0],
 * a one-layer step whose buffers fit s->B rows) and its head, in one call. Pass 0 runs s->B one-token rows:
 * row b the token tok0[b] with the target's hidden state h0[hrow[b]] at position pos0[b] of sequence seq0[b]
 * (a row of pages); its rows pick[0..A) draft sequence a's first token. Pass j > 0 runs a row for each
 * drafting sequence a with count[a] > j (pages row drafting[a]): its draft j - 1 with the layer's previous
 * output (before shared_head's norm), at position last[a] + j. A row at position p: its slot
 * page[p / bs] * bs + p % bs, its context p + 1, cos and sin row p of the rotary tables rounded to bf16. A
 * pass: x = eh (enorm(embed[tok]) ++ hnorm(h)), the decoder layer with shared_head's norm as the step's
 * final norm, logits = y head^T over the first V of Vh outputs, the draft their first largest (torch's
 * argmax). These are the kernels that models/mtp.py's forward and logits call, in that order. A sequence
 * with temp[a] > 0 (temp NULL: none) draws its draft j instead from q = softmax(logits / temp[a]) in
 * float32, with the uniform u[a * n + j] (mtp_sample), and q goes to row a * n + j of q (V floats each):
 * the distribution rejection sampling verifies it against. With a token map (vocab not NULL: the
 * token ids of the head's V rows) a draft is vocab[its row]. drafts (A, n), n = max count: sequence a's
 * in its first count[a]. Returns 0, -1 (out of memory) or the step's error (nothing after it ran). */
typedef struct {
    const void *embed, *enorm, *hnorm, *eh, *head; /* (V', D), (D), (D), panels (D, 2D), panels (Vh, D); bf16 */
    const float *cos, *sin;                        /* rotary tables (positions, R) float32 */
    int64_t V, Vh, A, M, bs;                       /* vocabulary, head outputs, drafting sequences, pages, block size */
    const int64_t *pages;                          /* (sequences, M), -1 past each table's end */
    const int64_t *tok0, *hrow, *pos0, *seq0;      /* pass 0's rows, (s->B) each */
    const void *h0;                                /* (T, D) bf16: the target's last hidden states */
    const int64_t *pick, *drafting, *last, *count; /* (A) each */
    const float *temp, *u;                         /* (A) temperatures, 0: greedy; (A, n) uniforms; or NULL */
    float *q;                                      /* (A, n, V): the sampled drafts' distributions */
    const int64_t *vocab;                          /* (V) the head rows' token ids, or NULL: row v is token v */
} shuttle_mtp;

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* A draw from q = softmax(l / temp) over the V bf16 logits l (each divided in float32, as torch's
 * logits.float() / temp), written to q: the first token whose running sum of q exceeds u times the
 * total (kernels/sampling._inverse_cdf: the target kept below the total, so a token of q 0 is never
 * drawn). Logits whose exponentials do not sum to a finite positive total (NaN, +inf) give q one-hot
 * at their first largest finite value, and that token. */
static int64_t mtp_sample(const uint16_t *l, int64_t V, float temp, float u, float *q) {
    const __m256 t8 = _mm256_set1_ps(temp);
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
        const __m256 x = _mm256_div_ps(bf16x8_to_f32(l + v), t8);
        _mm256_storeu_ps(q + v, x);
        top8 = _mm256_max_ps(top8, x);
    }
    float top = hmax8(top8);
    for (; v < V; v++) top = fmaxf(top, q[v] = bf16_to_f32(l[v]) / temp);
    const __m256 top_8 = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (v = 0; v + 8 <= V; v += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(q + v), top_8));
        _mm256_storeu_ps(q + v, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float total = hsum8(sum8);
    for (; v < V; v++) total += q[v] = expf(q[v] - top);
    if (!(total > 0.0f && total < INFINITY)) {
        int64_t best = 0;
        float most = -INFINITY;
        for (v = 0; v < V; v++)
            if (bf16_to_f32(l[v]) > most && bf16_to_f32(l[v]) < INFINITY) most = bf16_to_f32(l[v]), best = v;
        memset(q, 0, (size_t)V * sizeof(float));
        q[best] = 1.0f;
        return best;
    }
    const float inv = 1.0f / total;
    float run = 0.0f;
    for (v = 0; v < V; v++) run += q[v] *= inv;
    const float target = fminf(u * run, nextafterf(run, 0.0f));
    int64_t pick = -1;
    run = 0.0f;
    for (v = 0; v < V && pick < 0; v++)
        if ((run += q[v]) > target) pick = v;
    return pick >= 0 ? pick : V - 1;
}

/* The step's B rows: row b at position pos[i] + add of sequence seq[i], i = idx[b] (idx NULL: b). Their
 * slots, table rows, lengths, cos and sin. */
static void mtp_rows(shuttle_step *s, const shuttle_mtp *m, int64_t B, const int64_t *idx, const int64_t *pos,
                     int64_t add, const int64_t *seq, int64_t *slots, int64_t *table, int64_t *len, uint16_t *cos,
                     uint16_t *sin) {
    const int64_t M = m->M, R = s->R, bs = m->bs;
    for (int64_t b = 0; b < B; b++) {
        const int64_t i = idx ? idx[b] : b, p = pos[i] + add, *pages = m->pages + seq[i] * M;
        memcpy(table + b * M, pages, (size_t)M * 8);
        slots[b] = pages[p / bs] * bs + p % bs, len[b] = p + 1;
        for (int64_t r = 0; r < R; r++) cos[b * R + r] = to_bf(m->cos[p * R + r]), sin[b * R + r] = to_bf(m->sin[p * R + r]);
    }
    s->B = B, s->M = M, s->slots = slots, s->table = table, s->len = len, s->cos = cos, s->sin = sin;
}

int shuttle_mtp_draft(const shuttle_step *s0, const shuttle_layer *layer, const shuttle_mtp *m, int64_t n,
                      int64_t *drafts) {
    const int64_t D = s0->D, A = m->A, B0 = s0->B, R = s0->R;
    const int nt = (int)s0->threads;
    const float eps = (float)s0->eps;
    shuttle_step s = *s0;
    int64_t *ints = malloc((size_t)(B0 * (m->M + 3) + 2 * A) * 8);
    uint16_t *bf = malloc((size_t)(B0 * (2 * R + 3 * D) + A * (2 * D + m->Vh)) * 2);
    if (!ints || !bf) {
        free(ints), free(bf);
        return -1;
    }
    int64_t *slots = ints, *len = slots + B0, *table = len + B0, *tok = table + B0 * m->M, *act = tok + A;
    uint16_t *cos = bf, *sin = cos + B0 * R, *cat = sin + B0 * R, *x = cat + 2 * B0 * D, *hn = x + B0 * D,
             *hnext = hn + A * D, *logits = hnext + A * D;
    const uint16_t *embed = m->embed, *h = m->h0;
    int64_t na = A; /* the drafting sequences of this pass: act[0..na) */
    for (int64_t a = 0; a < A; a++) act[a] = a;
    int rc = 0;
    for (int64_t j = 0; j < n; j++) {
        if (j) { /* the sequences drafting on, their draft and output kept in order */
            int64_t w = 0;
            for (int64_t i = 0; i < na; i++)
                if (m->count[act[i]] > j) {
                    if (w != i) memcpy(hnext + w * D, hnext + i * D, (size_t)D * 2);
                    tok[w] = tok[i], act[w++] = act[i];
                }
            if (!(na = w))
                break;
            mtp_rows(&s, m, na, act, m->last, j, m->drafting, slots, table, len, cos, sin);
        } else {
            mtp_rows(&s, m, B0, NULL, m->pos0, 0, m->seq0, slots, table, len, cos, sin);
        }
        for (int64_t b = 0; b < s.B; b++) {
            shuttle_add_rms_norm(embed + (j ? tok[b] : m->tok0[b]) * D, NULL, m->enorm, cat + b * 2 * D, NULL, 1, D,
                                 eps, 1, 1);
            shuttle_add_rms_norm(h + (j ? b : m->hrow[b]) * D, NULL, m->hnorm, cat + b * 2 * D + D, NULL, 1, D, eps,
                                 1, 1);
        }
        shuttle_gemm_bf16_panels(cat, s.B, 2 * D, m->eh, D, x, nt);
        s.x = x;
        if ((rc = shuttle_decode_step(&s, layer, 1)))
            break;
        for (int64_t i = 0; i < na; i++) { /* the rows that draft: their normed output, and the next pass's h */
            const int64_t row = j ? i : m->pick[i];
            memcpy(hn + i * D, (const uint16_t *)s.y + row * D, (size_t)D * 2);
            memcpy(hnext + i * D, (const uint16_t *)s.r + row * D, (size_t)D * 2);
        }
        if (!na) /* (no sequence drafts: the pass only cached the rows' keys and values) */
            break;
        shuttle_gemm_bf16_panels(hn, na, D, m->head, m->Vh, logits, nt);
        for (int64_t i = 0; i < na; i++) {
            const uint16_t *l = logits + i * m->Vh;
            const int64_t a = act[i];
            int64_t best = 0;
            if (m->temp && m->temp[a] > 0) {
                best = mtp_sample(l, m->V, m->temp[a], m->u[a * n + j], m->q + (a * n + j) * m->V);
            } else {
                float top = bf16_to_f32(l[0]);
                for (int64_t v = 1; v < m->V; v++)
                    if (bf16_to_f32(l[v]) > top) top = bf16_to_f32(l[v]), best = v;
            }
            drafts[a * n + j] = tok[i] = m->vocab ? m->vocab[best] : best;
        }
        h = hnext;
    }
    free(ints), free(bf);
    return rc;
}
#else
int shuttle_decode_step(void) { return -2; }
int shuttle_mtp_draft(void) { return -2; }
int shuttle_decode_attention(void) { return -2; }
#endif
