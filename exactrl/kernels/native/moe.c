/* exactrl's routed experts for inference (float32): a mixture-of-experts layer's routing and its experts'
 * gated MLPs in one call, with the bits of model/moe.py's module path (the trainer's), which states the rule:
 *
 *     lp  = exactrl_log_softmax(z)                  each row of router logits z [N, E] (pointwise.c)
 *     p   = exp_f(lp)                               the kernels' exp (exp_f.h), elementwise
 *     S   = the K largest p of the row, in descending order, equal p: the lower expert first, NaN before
 *           any number (torch.sort(descending=True, stable=True) of the row, its first K)
 *     w_j = p_(S_j), or with `normalise` p_(S_j) / total, total = ((w_0 + w_1) + w_2) + ...
 *     out = 0, then for each expert e ascending, for each row routed to it:
 *           out_row = out_row + down_e(silu(gate_e(x_row)) * up_e(x_row)) * w
 *
 * Each expert's products go through gemm.c's exact linear on the rows routed to it (a row's bits never
 * depend on the other rows), gate and up in one exactrl_linear_multi call (the same bits as two calls), and
 * SwiGLU through pointwise.c's. Every sum and product above rounds once, in this order (no contraction:
 * -ffp-contract=off), as torch's elementwise ops do.
 *
 * Why one call: a decode step routes a few rows to each expert, and the Python around E small products per
 * layer (gather, products, scale, scatter-add) costs more than their arithmetic; one call also lets a decode
 * graph (graph.c) replay the layer, whose experts depend on the step's data.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_f.h"

void exactrl_log_softmax(const float *, int64_t, int64_t, float *, int);
void exactrl_linear_multi(const float *, const float *, int64_t, int64_t, int64_t, const int64_t *, float *, int);
void exactrl_linear(const float *, const float *, int64_t, int64_t, int64_t, float *, int);
void exactrl_swiglu(const float *, const float *, int64_t, float *, int);

/* a comes before b in a stable descending sort (torch's order: NaN above every number) */
static inline int before(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

/* The routing of rows [N, E] of probabilities p: experts [N, K] and their weights [N, K]. */
static void route(const float *p, int64_t N, int64_t E, int64_t K, int normalise, int64_t *experts, float *weights) {
    for (int64_t r = 0; r < N; r++) {
        const float *pr = p + r * E;
        int64_t *sel = experts + r * K;
        float *w = weights + r * K;
        for (int64_t j = 0; j < K; j++) { /* the j-th of the stable descending order: the first best not taken */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= sel[i] == e;
                if (!taken && (best < 0 || before(pr[e], pr[best]))) best = e;
            }
            sel[j] = best;
            w[j] = pr[best];
        }
        if (normalise) {
            float total = w[0];
            for (int64_t j = 1; j < K; j++) total = total + w[j];
            for (int64_t j = 0; j < K; j++) w[j] = w[j] / total;
        }
    }
}

/* out [N, D] of rows x [N, D] with router logits z [N, E]; gate_up[e] is the address of expert e's gate and up
 * weights packed one after another (F rows each, as exactrl_linear_multi reads them), down[e] its down
 * weight's panels [D, F]. Writes the selection: experts [N, K] (int64) and weights [N, K]. Returns 0, or 1
 * where its scratch memory could not be allocated (out is then not written). */
int exactrl_moe(const float *x, const float *z, int64_t N, int64_t D, int64_t E, int64_t K, int64_t F, int normalise,
                const int64_t *gate_up, const int64_t *down, float *out, int64_t *experts, float *weights,
                int threads) {
    float *p = malloc(sizeof(float) * (N * E + N + N * D + N * 2 * F + N * F + N * D + 1));
    int64_t *rows = malloc(sizeof(int64_t) * (N + 1));
    if (!p || !rows) {
        free(p);
        free(rows);
        return 1;
    }
    float *w_row = p + N * E, *xs = w_row + N, *gu = xs + N * D, *h = gu + N * 2 * F, *y = h + N * F;
    exactrl_log_softmax(z, N, E, p, threads);
    for (int64_t i = 0; i < N * E; i++) p[i] = exp_f(p[i]);
    route(p, N, E, K, normalise, experts, weights);
    memset(out, 0, sizeof(float) * N * D);
    const int64_t Ns[2] = {F, F};
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t r = 0; r < N; r++)
            for (int64_t j = 0; j < K; j++)
                if (experts[r * K + j] == e) {
                    rows[n] = r;
                    w_row[n++] = weights[r * K + j];
                }
        if (!n) continue;
        for (int64_t i = 0; i < n; i++) memcpy(xs + i * D, x + rows[i] * D, sizeof(float) * D);
        exactrl_linear_multi(xs, (const float *)(intptr_t)gate_up[e], n, D, 2, Ns, gu, threads);
        exactrl_swiglu(gu, gu + n * F, n * F, h, threads);
        exactrl_linear(h, (const float *)(intptr_t)down[e], n, D, F, y, threads);
        for (int64_t i = 0; i < n; i++) {
            float *o = out + rows[i] * D;
            const float *yi = y + i * D, wi = w_row[i];
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + yi[d] * wi;
        }
    }
    free(p);
    free(rows);
    return 0;
}
