/* DeepSeek-V4's hyper-connection weights (models/deepseek_v4.HyperConnection) from the learned map's
 * output, per token: pre = sigmoid(w_pre * s0 + b_pre) + eps, post = 2 sigmoid(w_post * s1 + b_post),
 * comb = softmax over rows of (w_comb * s2 + b_comb) + eps, then Sinkhorn-Knopp: columns normalised
 * once, then rows and columns alternately iters - 1 times (each sum + eps). The torch path is ~120
 * small ops on (T, n, n) tensors a call, 0.3-0.6 ms at decode sizes and two calls a layer; here one
 * pass over each token's few values. Same operations in the same order, in float32.
 *
 * mixed: (T, (2 + n) n) float32 contiguous; base: ((2 + n) n); scale: (3); pre, post: (T, n);
 * comb: (T, n, n), row i = the input stream, column j = the output stream, as torch's (T, n, n). */
#include <math.h>
#include <stdint.h>

void shuttle_hyper_weights(const float *mixed, const float *base, const float *scale, float *pre, float *post,
                           float *comb, int64_t T, int64_t n, int iters, float eps) {
    const int64_t width = (2 + n) * n;
    for (int64_t t = 0; t < T; t++) {
        const float *m = mixed + t * width;
        float *pr = pre + t * n, *po = post + t * n, *c = comb + t * n * n;
        for (int64_t i = 0; i < n; i++) {
            pr[i] = 1.0f / (1.0f + expf(-(m[i] * scale[0] + base[i]))) + eps;
            po[i] = 2.0f / (1.0f + expf(-(m[n + i] * scale[1] + base[n + i])));
        }
        for (int64_t i = 0; i < n; i++) {  /* softmax of each row, + eps */
            float *row = c + i * n, mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                row[j] = m[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j];
                mx = fmaxf(mx, row[j]);
            }
            for (int64_t j = 0; j < n; j++) sum += (row[j] = expf(row[j] - mx));
            for (int64_t j = 0; j < n; j++) row[j] = row[j] / sum + eps;
        }
        for (int it = 0; it < iters; it++) {
            if (it > 0) {  /* rows */
                for (int64_t i = 0; i < n; i++) {
                    float sum = 0.0f;
                    for (int64_t j = 0; j < n; j++) sum += c[i * n + j];
                    for (int64_t j = 0; j < n; j++) c[i * n + j] /= sum + eps;
                }
            }
            for (int64_t j = 0; j < n; j++) {  /* columns */
                float sum = 0.0f;
                for (int64_t i = 0; i < n; i++) sum += c[i * n + j];
                for (int64_t i = 0; i < n; i++) c[i * n + j] /= sum + eps;
            }
        }
    }
}
