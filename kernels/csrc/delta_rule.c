/* One decode step of the gated delta rule (Qwen3-Next's linear attention), updating each sequence's
 * float32 state in place in the state cache: the torch path (kernels/delta_rule.py) gathers the
 * states of the batch, decays them, reads, writes an outer product and reads again, each a pass
 * over B x Hv x K x V floats plus the gather and the write-back (about ten passes; at batch 64 a
 * 64 x 64 state per head took 46 ms a layer on one AMX Xeon core). Here each (sequence, value head)
 * state is read once and written once: pass 1 decays it and forms S^T k, pass 2 adds k delta^T and
 * forms S^T q while the tile (K x V floats, 16-64 KiB) is still in cache.
 *
 * q, k: (B, Hv, K) float32, already L2-normalised (q also scaled by K^-1/2) and repeated to the Hv
 * value heads; v: (B, Hv, V); g, beta: (B, Hv) float32; states: (S, Hv, K, V) float32 contiguous;
 * slots: (B) int64 rows of states; fresh: (B) uint8, 1 where the sequence starts from zeros;
 * out: (B, Hv, V) float32. OpenMP over (sequence, head) pairs. */
#include <math.h>
#include <stdint.h>
#include <string.h>

void shuttle_delta_rule_decode(const float *q, const float *k, const float *v, const float *g, const float *beta,
                               float *states, const int64_t *slots, const uint8_t *fresh, float *out, int64_t B,
                               int64_t Hv, int64_t K, int64_t V, int nthreads) {
    const int parallel = nthreads > 1 && B * Hv * K * V >= (1 << 16);
    #pragma omp parallel for num_threads(parallel ? nthreads : 1) schedule(static)
    for (int64_t bh = 0; bh < B * Hv; bh++) {
        const int64_t b = bh / Hv, h = bh % Hv;
        float *S = states + (slots[b] * Hv + h) * K * V;
        const float *qb = q + bh * K, *kb = k + bh * K, *vb = v + bh * V;
        float *ob = out + bh * V;
        float mem[V], delta[V];
        if (fresh[b]) memset(S, 0, sizeof(float) * K * V);
        const float decay = expf(g[bh]), bt = beta[bh];
        for (int64_t j = 0; j < V; j++) mem[j] = 0.0f;
        for (int64_t i = 0; i < K; i++) {  /* S *= exp(g); mem = S^T k */
            float *Si = S + i * V;
            const float ki = kb[i];
            #pragma omp simd
            for (int64_t j = 0; j < V; j++) {
                Si[j] *= decay;
                mem[j] += Si[j] * ki;
            }
        }
        for (int64_t j = 0; j < V; j++) {
            delta[j] = (vb[j] - mem[j]) * bt;
            ob[j] = 0.0f;
        }
        for (int64_t i = 0; i < K; i++) {  /* S += k delta^T; o = S^T q */
            float *Si = S + i * V;
            const float ki = kb[i], qi = qb[i];
            #pragma omp simd
            for (int64_t j = 0; j < V; j++) {
                Si[j] += ki * delta[j];
                ob[j] += Si[j] * qi;
            }
        }
    }
}
