/* exactrl's native elementwise and row kernels (float32): SwiGLU, GeGLU and logit soft-capping and their
 * gradients, the sampling distribution's log-softmax, the engine's token draw, and the LM head's entropy and
 * logit gradient.
 *
 * None of them reduces across rows, so none can make a row depend on the batch; each exists to do in one
 * pass over memory what takes several torch ops (and as many passes). Where a kernel sums (a row's
 * entropy, the draw's block masses) it does so in a fixed order of its own: the same bits for a row
 * whatever else is in the call.
 *
 * exp is `exp_f` (exp_f.h), not libm's: plain float arithmetic that the compiler vectorises, so every build
 * (AVX-512, AVX2, no vectors) gives the same bits, and a loop of it runs at vector speed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "exp_f.h"
#include "fpmode.h"

void exactrl_exp(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = exp_f(x[i]);
}

#define CHUNK 4096 /* elements per parallel work item of the flat loops */

/* out = silu(g) * u = g / (1 + exp(-g)) * u, elementwise over n floats. */
void exactrl_swiglu(const float *g, const float *u, int64_t n, float *out, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 4 * CHUNK)
    for (int64_t c = 0; c < n; c += CHUNK) {
        FP_MODE_ENTER;
        const int64_t end = c + CHUNK < n ? c + CHUNK : n;
        for (int64_t i = c; i < end; i++) out[i] = g[i] / (1.0f + exp_f(-g[i])) * u[i];
        FP_MODE_LEAVE;
    }
}

/* The gradient of out = silu(g) * u, with s = 1 / (1 + exp(-g)) and silu(g) = g s:
 *     du = dy silu(g),   dg = dy u s (1 + g (1 - s)). */
void exactrl_swiglu_backward(const float *g, const float *u, const float *dy, int64_t n, float *dg, float *du,
                             int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 4 * CHUNK)
    for (int64_t c = 0; c < n; c += CHUNK) {
        FP_MODE_ENTER;
        const int64_t end = c + CHUNK < n ? c + CHUNK : n;
        for (int64_t i = c; i < end; i++) {
            const float s = 1.0f / (1.0f + exp_f(-g[i]));
            du[i] = dy[i] * (g[i] * s);
            dg[i] = dy[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
        }
        FP_MODE_LEAVE;
    }
}

/* gelu's tanh approximation (Gemma's GeGLU), tanh_f(exp_f.h) for tanh:
 *     gelu(g) = 0.5 g (1 + t),   t = tanh(c (g + 0.044715 g^3)),   c = sqrt(2 / pi)
 *     gelu'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 * 0.044715 g^2) */
#define GELU_C 0.7978845608028654f
#define GELU_K 0.044715f
static inline float gelu_t(float g) { return tanh_f(GELU_C * (g + GELU_K * (g * g * g))); }

/* out = gelu(g) * u, elementwise over n floats. */
void exactrl_geglu(const float *g, const float *u, int64_t n, float *out, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 4 * CHUNK)
    for (int64_t c = 0; c < n; c += CHUNK) {
        FP_MODE_ENTER;
        const int64_t end = c + CHUNK < n ? c + CHUNK : n;
        for (int64_t i = c; i < end; i++) out[i] = 0.5f * g[i] * (1.0f + gelu_t(g[i])) * u[i];
        FP_MODE_LEAVE;
    }
}

/* The gradient of out = gelu(g) * u:  du = dy gelu(g),  dg = dy u gelu'(g) (gelu' above). */
void exactrl_geglu_backward(const float *g, const float *u, const float *dy, int64_t n, float *dg, float *du,
                            int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 4 * CHUNK)
    for (int64_t c = 0; c < n; c += CHUNK) {
        FP_MODE_ENTER;
        const int64_t end = c + CHUNK < n ? c + CHUNK : n;
        for (int64_t i = c; i < end; i++) {
            const float x = g[i], t = gelu_t(x);
            du[i] = dy[i] * (0.5f * x * (1.0f + t));
            const float slope = 0.5f * x * (1.0f - t * t) * GELU_C * (1.0f + 3.0f * GELU_K * x * x);
            dg[i] = dy[i] * u[i] * (0.5f * (1.0f + t) + slope);
        }
        FP_MODE_LEAVE;
    }
}

/* Logit soft-capping (Gemma 2): out = cap tanh(x / cap), elementwise over n floats. */
void exactrl_softcap(const float *x, int64_t n, float cap, float *out, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 4 * CHUNK)
    for (int64_t c = 0; c < n; c += CHUNK) {
        FP_MODE_ENTER;
        const int64_t end = c + CHUNK < n ? c + CHUNK : n;
        for (int64_t i = c; i < end; i++) out[i] = cap * tanh_f(x[i] / cap);
        FP_MODE_LEAVE;
    }
}

/* out = x clamped to [lo, hi], elementwise over n floats (OLMoE's clip_qkv): torch.clamp's bits (NaN stays NaN,
 * -0.0 stays -0.0). */
void exactrl_clamp(const float *x, int64_t n, float lo, float hi, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] < lo ? lo : (x[i] > hi ? hi : x[i]);
}

/* A gate per row (Qwen2-MoE's shared expert): out[r, d] = y[r, d] * s_r, s_r = 1 / (1 + exp(-g_r)), for rows
 * g [R], y [R, D]. */
void exactrl_sigmoid_gate(const float *g, const float *y, int64_t R, int64_t D, float *out) {
    for (int64_t r = 0; r < R; r++) {
        const float s = 1.0f / (1.0f + exp_f(-g[r]));
        for (int64_t d = 0; d < D; d++) out[r * D + d] = y[r * D + d] * s;
    }
}

/* The gradient of out = cap tanh(x / cap):  dx = dy (1 - t^2),  t = tanh(x / cap) recomputed from x.
 * dx may be dy (in place). */
void exactrl_softcap_backward(const float *x, const float *dy, int64_t n, float cap, float *dx, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 4 * CHUNK)
    for (int64_t c = 0; c < n; c += CHUNK) {
        FP_MODE_ENTER;
        const int64_t end = c + CHUNK < n ? c + CHUNK : n;
        for (int64_t i = c; i < end; i++) {
            const float t = tanh_f(x[i] / cap);
            dx[i] = dy[i] * (1.0f - t * t);
        }
        FP_MODE_LEAVE;
    }
}

#define LANES 8
#define SUM_LANES 16 /* running sums of a log-softmax row: one AVX-512 vector */

/* log_softmax of each row of z [R, V], one thread per row:
 *     m     = max_j z_j                                          (exact in any order)
 *     s     = sum_j exp(z_j - m)   in float32: SUM_LANES running sums (j mod SUM_LANES), then a fixed tree
 *     out_j = (z_j - m) - (float)log(s)                          (log in float64, libm)
 * A row holding a NaN, or nothing above -inf, comes out NaN everywhere (exp of NaN makes s NaN), as torch's
 * log_softmax does. 512-bit vectors where the CPU has them, faster than the compiler's default width of 256
 * bits; the same bits either way. */
/* log_softmax's two reductions of a row: *m = max_j z_j and the return value (float)log(s) (see below). */
#if defined(__AVX512F__)
__attribute__((target("prefer-vector-width=512")))
#endif
static inline __attribute__((always_inline)) float max_logsum(const float *row, int64_t V, float *m_out) {
    float mx[SUM_LANES];
    float acc[SUM_LANES];
    for (int i = 0; i < SUM_LANES; i++) mx[i] = -INFINITY, acc[i] = 0.0f;
    int64_t j = 0;
    for (; j + SUM_LANES <= V; j += SUM_LANES)
        for (int i = 0; i < SUM_LANES; i++) mx[i] = row[j + i] > mx[i] ? row[j + i] : mx[i];
    for (int i = 0; j < V; j++, i++) mx[i] = row[j] > mx[i] ? row[j] : mx[i];
    float m = mx[0];
    for (int i = 1; i < SUM_LANES; i++) m = mx[i] > m ? mx[i] : m;
    for (j = 0; j + SUM_LANES <= V; j += SUM_LANES)
        for (int i = 0; i < SUM_LANES; i++) acc[i] += exp_f(row[j + i] - m);
    for (int i = 0; j < V; j++, i++) acc[i] += exp_f(row[j] - m);
    for (int w = SUM_LANES / 2; w > 0; w /= 2) /* the fixed tree: lane i + w into lane i */
        for (int i = 0; i < w; i++) acc[i] += acc[i + w];
    *m_out = m;
    return (float)log(acc[0]);
}

#if defined(__AVX512F__)
__attribute__((target("prefer-vector-width=512")))
#endif
void exactrl_log_softmax(const float *z, int64_t R, int64_t V, float *out, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= (1 << 15))
    for (int64_t r = 0; r < R; r++) {
        FP_MODE_ENTER;
        const float *row = z + r * V;
        float *o = out + r * V, m;
        const float ls = max_logsum(row, V, &m);
        for (int64_t j = 0; j < V; j++) o[j] = (row[j] - m) - ls;
        FP_MODE_LEAVE;
    }
}

/* The log-probability of token j of a row: the row itself (lp), or log_softmax of logits computed on the fly,
 * (z_j - m) - ls, the same expression and so the same bits as exactrl_log_softmax's output. */
#define LP(row, j, shift, m, ls) ((shift) ? ((row)[j] - (m)) - (ls) : (row)[j])

/* sum_j exp(lp_j) over [a, b) in float64: LANES running sums (j mod LANES), then a fixed tree. */
static inline __attribute__((always_inline)) double exp_mass(const float *row, int64_t a, int64_t b, int shift,
                                                             float m, float ls) {
    double acc[LANES] = {0};
    int64_t j = a;
    for (; j + LANES <= b; j += LANES)
        for (int i = 0; i < LANES; i++) acc[i] += (double)exp_f(LP(row, j + i, shift, m, ls));
    for (int i = 0; j < b; j++, i++) acc[i] += (double)exp_f(LP(row, j, shift, m, ls));
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* One row's draw (exactrl_draw's rule, below); returns the token, -1 if the row cannot be drawn from. */
static inline __attribute__((always_inline)) int64_t draw_row(const float *row, int64_t V, int64_t W, double u,
                                                              int greedy, double *cdf, int shift, float m, float ls) {
    const int64_t nb = (V + W - 1) / W;
    int64_t t = 0;
    if (greedy) {
        float best = LP(row, 0, shift, m, ls);
        for (int64_t j = 1; j < V; j++) {
            const float x = LP(row, j, shift, m, ls);
            if (x > best) best = x, t = j;
        }
        return best > -INFINITY ? t : -1;
    }
    double run = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t end = (b + 1) * W < V ? (b + 1) * W : V;
        run += exp_mass(row, b * W, end, shift, m, ls);
        cdf[b] = run;
    }
    if (!(cdf[nb - 1] > 0.0)) return -1;
    double x = u * cdf[nb - 1];
    const double top = nextafter(cdf[nb - 1], 0.0);
    x = x < top ? x : top;
    int64_t b = 0;
    while (b < nb - 1 && cdf[b] <= x) b++;
    double rest = x - (b > 0 ? cdf[b - 1] : 0.0);
    const int64_t start = b * W, end = (b + 1) * W < V ? (b + 1) * W : V;
    double in = 0.0;
    for (int64_t j = start; j < end; j++) in += (double)exp_f(LP(row, j, shift, m, ls));
    const double in_top = nextafter(in, 0.0);
    rest = rest < in_top ? rest : in_top;
    double c = 0.0;
    for (int64_t j = start; j < end; j++) {
        c += (double)exp_f(LP(row, j, shift, m, ls));
        if (c > rest) return j;
    }
    return end - 1;
}

/* One token per row of lp [R, V] (log-probabilities), by inverse CDF at u[r] in [0, 1), in two levels and
 * float64 throughout (a token's share stays resolvable down to ~1e-16):
 *     m_b   = mass of block b (tokens bW .. bW + W - 1),  C_b = m_0 + ... + m_b (b ascending)
 *     x     = u C_last, kept below C_last
 *     b     = the first block with C_b > x
 *     token = the first j of block b whose running mass from the block's start exceeds x - C_(b-1)
 *             (kept below that running mass's block total: the two sums of one block may round apart)
 * so the token is never one of probability 0. A greedy row (greedy[r] != 0) takes the first argmax instead.
 * tok[r] is the token, tok_lp[r] its log-probability. A row that cannot be drawn from, its total mass NaN or 0
 * (a NaN in it, or nothing above -inf) or, greedy, its maximum NaN or -inf, gets tok[r] = -1 and a NaN
 * tok_lp[r]: the caller's check of the step's logits costs no pass of its own. Each row is drawn by one
 * thread; `mass` is scratch of threads * ceil(V / W) doubles. */
#if defined(__AVX512F__)
__attribute__((target("prefer-vector-width=512")))
#endif
static inline __attribute__((always_inline)) void draw_rows(const float *x, int64_t R, int64_t V, int64_t W,
                                                            const double *u, const uint8_t *greedy, int64_t *tok,
                                                            float *tok_lp, double *mass, int threads, int shift) {
    const int64_t nb = (V + W - 1) / W;
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        FP_MODE_ENTER;
#ifdef _OPENMP
        double *cdf = mass + (int64_t)omp_get_thread_num() * nb;
#else
        double *cdf = mass;
#endif
        const float *row = x + r * V;
        float m = 0.0f, ls = 0.0f;
        if (shift) ls = max_logsum(row, V, &m);
        const int64_t t = draw_row(row, V, W, u[r], greedy[r], cdf, shift, m, ls);
        tok[r] = t;
        tok_lp[r] = t < 0 ? NAN : LP(row, t, shift, m, ls);
        FP_MODE_LEAVE;
    }
}

#if defined(__AVX512F__)
__attribute__((target("prefer-vector-width=512")))
#endif
void exactrl_draw(const float *lp, int64_t R, int64_t V, int64_t W, const double *u, const uint8_t *greedy,
                  int64_t *tok, float *tok_lp, double *mass, int threads) {
    draw_rows(lp, R, V, W, u, greedy, tok, tok_lp, mass, threads, 0);
}

/* exactrl_log_softmax then exactrl_draw, for rows of logits z [R, V], without writing the log-probabilities:
 * each lp_j is computed where the draw reads it, by the same expression, so token and logprob are those
 * bits of the two calls. (The engine's step when no row needs temperature, top-k or top-p: a [R, V] row
 * of log-probabilities is neither written nor read back.) */
#if defined(__AVX512F__)
__attribute__((target("prefer-vector-width=512")))
#endif
void exactrl_sample(const float *z, int64_t R, int64_t V, int64_t W, const double *u, const uint8_t *greedy,
                    int64_t *tok, float *tok_lp, double *mass, int threads) {
    draw_rows(z, R, V, W, u, greedy, tok, tok_lp, mass, threads, 1);
}

/* Entropy of each row of lp [R, V]: H = -sum_j p_j lp_j with p_j = exp(lp_j) (a term with p_j = 0 counts 0),
 * summed in float32 in LANES running sums (j mod LANES) and a fixed tree. */
static inline float entropy_term(float lp) {
    const float p = exp_f(lp);
    return p * (p == 0.0f ? 0.0f : lp);
}
static inline float entropy_of_lanes(const float *acc) {
    return -(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
}

void exactrl_entropy(const float *lp, int64_t R, int64_t V, float *ent, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        FP_MODE_ENTER;
        const float *row = lp + r * V;
        float acc[LANES] = {0};
        int64_t j = 0;
        for (; j + LANES <= V; j += LANES)
            for (int i = 0; i < LANES; i++) acc[i] += entropy_term(row[j + i]);
        for (int i = 0; j < V; j++, i++) acc[i] += entropy_term(row[j]);
        ent[r] = entropy_of_lanes(acc);
        FP_MODE_LEAVE;
    }
}

/* exactrl_log_softmax then exactrl_entropy of its output, in one pass that writes each log-probability where the
 * entropy reads it: the bits of the two calls. out may be z (in place: each element is read before it is
 * written). The LM head's forward in training: one pass over [rows, vocabulary] fewer, and no new tensor. */
#if defined(__AVX512F__)
__attribute__((target("prefer-vector-width=512")))
#endif
void exactrl_log_softmax_entropy(const float *z, int64_t R, int64_t V, float *out, float *ent, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && R * V >= (1 << 15))
    for (int64_t r = 0; r < R; r++) {
        FP_MODE_ENTER;
        const float *row = z + r * V;
        float *o = out + r * V, m, acc[LANES] = {0};
        const float ls = max_logsum(row, V, &m);
        int64_t j = 0;
#pragma GCC ivdep /* out may be z: element j is read, then written, by the same lane (vectorise anyway) */
        for (; j + LANES <= V; j += LANES)
            for (int i = 0; i < LANES; i++) {
                const float lp = (row[j + i] - m) - ls;
                o[j + i] = lp;
                acc[i] += entropy_term(lp);
            }
        for (int i = 0; j < V; j++, i++) {
            const float lp = (row[j] - m) - ls;
            o[j] = lp;
            acc[i] += entropy_term(lp);
        }
        ent[r] = entropy_of_lanes(acc);
        FP_MODE_LEAVE;
    }
}

/* The gradient with respect to the tempered logits z' of  sum_r g_lp[r] lp[r, tgt[r]] + g_ent[r] H[r]
 * (lp = log_softmax over the kept tokens, the cut-offs constant), per row r and token j, p = exp(lp):
 *     gz[r, j] = ( -g_lp[r] p_j + [j = tgt[r]] g_hit[r] - g_ent[r] p_j (lp_j + H[r]) ) / T
 * in that order of operations, with g_hit[r] = g_lp[r] unless the target itself was cut off (then 0,
 * passed in), and the entropy term 0 where p_j = 0 (none without g_ent: g_ent == NULL). */
static inline float head_grad_one(float lp, float a, float hit, const float *g_ent, float h, float temperature) {
    const float p = exp_f(lp);
    float v = p * a + hit;
    if (g_ent) v = v - (*g_ent * p) * ((p == 0.0f ? 0.0f : lp) + h);
    return v / temperature;
}

void exactrl_head_grad(const float *lp, int64_t R, int64_t V, const float *g_lp, const float *g_hit,
                       const int64_t *tgt, const float *g_ent, const float *ent, float temperature, float *gz,
                       int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        FP_MODE_ENTER;
        const float *row = lp + r * V;
        float *out = gz + r * V;
        const float a = -g_lp[r], h = g_ent ? ent[r] : 0.0f;
        const float *ge = g_ent ? g_ent + r : NULL;
        const float lp_t = row[tgt[r]];  /* read before the row is written: gz may be lp itself (in place) */
        /* gz may be lp (in place): element j is read, then written, by the same lane; vectorise anyway */
        if (ge) {
#pragma GCC ivdep
            for (int64_t j = 0; j < V; j++) out[j] = head_grad_one(row[j], a, 0.0f, ge, h, temperature);
        } else {
#pragma GCC ivdep
            for (int64_t j = 0; j < V; j++) out[j] = head_grad_one(row[j], a, 0.0f, NULL, h, temperature);
        }
        out[tgt[r]] = head_grad_one(lp_t, a, g_hit[r], ge, h, temperature);
        FP_MODE_LEAVE;
    }
}

/* out = a + b over n floats, b's nb floats repeated (nb = n: a residual add; nb = a row: a bias), as a kernel a
 * recorded graph can replay (graph.c). One IEEE sum per element, so the bits of torch's `a + b`. */
void exactrl_add(const float *a, const float *b, int64_t n, int64_t nb, float *out) {
    for (int64_t r = 0; r < n; r += nb)
        for (int64_t i = 0; i < nb; i++) out[r + i] = a[r + i] + b[i];
}

/* out = x * s over n floats, as a kernel a recorded graph can replay (graph.c): LoRA's α/r scaling. One IEEE
 * product per element with s a float, so the bits of torch's `x * s` for a float32 x and a Python number s
 * (torch rounds the number to float32 first, as the caller's ctypes float does). */
void exactrl_scale(const float *x, int64_t n, float s, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * s;
}
