/* exactrl's native exact kernels: causal attention over a paged KV store and its gradient, the KV store's
 * writes, RMSNorm and RoPE.
 *
 * Attention, one query row at a time.
 *
 * The reduction order of every output is fixed by the row alone (docs/design.md
 * §4.2): for query token n (sequence s, absolute position p) and head h,
 *
 *     s_t = (scale * q) . k_t            t = w..p, D summed in 8 fixed lanes, then a fixed tree
 *     m   = max_t s_t                    (a max is exact in any order)
 *     l   = sum_t exp(s_t - m)           t ascending, one running sum
 *     o   = (sum_t exp(s_t - m) * v_t) / l   t ascending, one running sum per feature
 *
 * with w = 0, or w = max(0, p - window + 1) for a sliding window of `window` keys (transformers' (p - window,
 * p]): the first key is a function of the row's own position, so its sums still start at one fixed key.
 * With a soft cap c > 0 (Gemma 2) each score is capped first, s_t = c tanh(s_t / c) (tanh_f, exp_f.h):
 * elementwise, so the order stays the row's own.
 *
 * Nothing depends on how many other rows, tokens or sequences share the call,
 * on where a key's page lies, on how a prompt was chunked, or on the thread
 * that computes the row (each row is computed by one thread, start to end):
 * decode against a cache, chunked prefill and a trainer's whole-sequence
 * forward give the same bits. Built with -ffp-contract=off and without
 * -ffast-math, so the compiler keeps exactly this order (vectorising only
 * the independent lanes); exp is exp_f.h's (vectorised over t, the same
 * bits on every CPU; libm's expf is one call per key, a large share of a
 * decode step's attention).
 *
 * Layouts: q [N, H, D]; k_pages, v_pages [P, Hk, B, D] (key t of sequence s
 * is slot t % B of page table[s, t / B]); out [N, H, D] float32. The query
 * heads h = kvh * G .. kvh * G + G - 1 share kv head kvh (G = H / Hk) and are
 * computed together so each key is read once for the G of them.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_f.h"
#include "fpmode.h"

#define LANES 8

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Dot product in LANES fixed partial sums, then a fixed tree: the same order for every call of a given D. */
static inline float dot(const float *a, const float *b, int64_t D) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES)
        for (int i = 0; i < LANES; i++) acc[i] += a[d + i] * b[d + i];
    for (int i = 0; d < D; d++, i++) acc[i] += a[d] * b[d];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Row `t` of a page store of either dtype, as float32 into buf (or a pointer into the store itself). */
static inline const float *load_row(const void *store, int bf16, int64_t row, int64_t D, float *buf) {
    if (!bf16) return (const float *)store + row * D;
    const uint16_t *src = (const uint16_t *)store + row * D;
    for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_float(src[d]);
    return buf;
}

/* Vectors of VB floats (GCC/clang vector extensions: SSE/AVX/NEON as the target has them). */
#define VB 8
typedef float vblock __attribute__((vector_size(VB * sizeof(float))));
typedef uint16_t vbits16 __attribute__((vector_size(VB * sizeof(uint16_t))));
typedef uint32_t vbits32 __attribute__((vector_size(VB * sizeof(uint32_t))));
#define MAX_G 16  /* query heads per kv head kept in registers; more take the plain loop */

/* VB floats of a page store at element `at`, as float32. */
static inline void load_block(const void *store, int bf16, int64_t at, vblock *v) {
    if (bf16) {  /* bf16 -> fp32 is exact: the 16 bits become the high half */
        vbits16 h;
        memcpy(&h, (const uint16_t *)store + at, sizeof h);
        const vbits32 w = __builtin_convertvector(h, vbits32) << 16;
        memcpy(v, &w, sizeof *v);
    } else {
        memcpy(v, (const float *)store + at, sizeof *v);
    }
}

/* acc[g, :] = sum_t e[g, t] * v_t for t = 0..L-1 in ascending order, one running sum per (g, d).
 * The loop runs over blocks of VB features outside and keys inside, so a block's G x VB sums stay in
 * registers while the keys pass (faster than a loop with the keys outside); each sum still adds its terms in
 * the order t = 0, 1, ..., L-1: the bits are those of either loop. */
#define FIXED_G 8  /* up to this many query heads per kv head, G is a compile-time constant (registers) */
#define WV_BLOCKS 4 /* feature blocks summed together while the keys pass: 4 x G independent running sums */

/* weighted_values' sums for features [d0, d0 + nb VB) with G and nb compile-time constants, so the G x nb
 * running sums live in registers and, being independent, overlap in the pipeline. */
static inline __attribute__((always_inline)) void wv_group(const int G, const int nb, const void *v_pages, int bf16,
                                                           const float *e, int64_t max_len, int64_t lo, int64_t L,
                                                           int64_t D, int64_t B, const int64_t *table_J, int64_t Hk,
                                                           int64_t kvh, float *acc, int64_t d0) {
    vblock a[FIXED_G][WV_BLOCKS];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < nb; j++) a[g][j] = (vblock){0};
    for (int64_t t0 = lo / B * B; t0 < L; t0 += B) {
        const int64_t base = (table_J[t0 / B] * Hk + kvh) * B - t0, end = t0 + B < L ? t0 + B : L;
        for (int64_t t = t0 > lo ? t0 : lo; t < end; t++) {
            vblock v[WV_BLOCKS];
            for (int j = 0; j < nb; j++) load_block(v_pages, bf16, (base + t) * D + d0 + j * VB, &v[j]);
            for (int g = 0; g < G; g++) {
                const float x = e[g * max_len + t];
                for (int j = 0; j < nb; j++) a[g][j] += x * v[j];
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < nb; j++) memcpy(acc + g * D + d0 + j * VB, &a[g][j], sizeof a[g][j]);
}

/* The features weighted_values' register paths cover (all whole blocks of VB), G a compile-time constant. */
static inline __attribute__((always_inline)) int64_t wv_fixed(const int G, const void *v_pages, int bf16,
                                                              const float *e, int64_t max_len, int64_t lo, int64_t L,
                                                              int64_t D, int64_t B, const int64_t *table_J,
                                                              int64_t Hk, int64_t kvh, float *acc) {
    int64_t d0 = 0;
    for (; d0 + WV_BLOCKS * VB <= D; d0 += WV_BLOCKS * VB)
        wv_group(G, WV_BLOCKS, v_pages, bf16, e, max_len, lo, L, D, B, table_J, Hk, kvh, acc, d0);
    for (; d0 + VB <= D; d0 += VB)
        wv_group(G, 1, v_pages, bf16, e, max_len, lo, L, D, B, table_J, Hk, kvh, acc, d0);
    return d0;
}

/* acc[g, :] = sum_t e[g, t] * v_t for t = lo..L-1 in ascending order. */
static void weighted_values(const void *v_pages, int bf16, const float *e, int64_t max_len, int64_t G, int64_t lo,
                            int64_t L, int64_t D, int64_t B, const int64_t *table_J, int64_t Hk, int64_t kvh,
                            float *acc, float *vbuf) {
    int64_t d0 = 0;
    switch (G) {
#define WV(g) case g: d0 = wv_fixed(g, v_pages, bf16, e, max_len, lo, L, D, B, table_J, Hk, kvh, acc); break;
        WV(1) WV(2) WV(3) WV(4) WV(5) WV(6) WV(7) WV(8)
#undef WV
    }
    if (G > FIXED_G && G <= MAX_G) {
        for (; d0 + VB <= D; d0 += VB) {
            vblock a[MAX_G];
            for (int64_t g = 0; g < G; g++) a[g] = (vblock){0};
            for (int64_t t0 = lo / B * B; t0 < L; t0 += B) {
                const int64_t base = (table_J[t0 / B] * Hk + kvh) * B - t0, end = t0 + B < L ? t0 + B : L;
                for (int64_t t = t0 > lo ? t0 : lo; t < end; t++) {
                    vblock v;
                    load_block(v_pages, bf16, (base + t) * D + d0, &v);
                    for (int64_t g = 0; g < G; g++) a[g] += e[g * max_len + t] * v;
                }
            }
            for (int64_t g = 0; g < G; g++) memcpy(acc + g * D + d0, &a[g], sizeof a[g]);
        }
    }
    if (d0 == D) return;
    for (int64_t g = 0; g < G; g++) memset(acc + g * D + d0, 0, sizeof(float) * (D - d0));
    for (int64_t t0 = lo / B * B; t0 < L; t0 += B) {
        const int64_t base = (table_J[t0 / B] * Hk + kvh) * B - t0, end = t0 + B < L ? t0 + B : L;
        for (int64_t t = t0 > lo ? t0 : lo; t < end; t++) {
            const float *v = load_row(v_pages, bf16, base + t, D, vbuf);
            for (int64_t g = 0; g < G; g++) {
                const float x = e[g * max_len + t];
                float *a = acc + g * D;
                for (int64_t d = d0; d < D; d++) a[d] += x * v[d];
            }
        }
    }
}

#if LANES != VB
#error "dots_fixed keeps dot's LANES sums in one vblock"
#endif
/* dot(q_g, k) for g < G (G a compile-time constant): dot's lanes and tree, the G sums side by side so their
 * chains of additions overlap; the same bits as G calls of dot. */
static inline __attribute__((always_inline)) void dots_fixed(const int G, const float *q, const float *k, int64_t D,
                                                             float *out, int64_t stride) {
    vblock acc[FIXED_G];
    for (int g = 0; g < G; g++) acc[g] = (vblock){0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) {
        vblock kv;
        memcpy(&kv, k + d, sizeof kv);
        for (int g = 0; g < G; g++) {
            vblock qv;
            memcpy(&qv, q + g * D + d, sizeof qv);
            acc[g] += qv * kv;
        }
    }
    for (int g = 0; g < G; g++) {
        float a[LANES];
        memcpy(a, &acc[g], sizeof a);
        int64_t dd = d;
        for (int i = 0; dd < D; dd++, i++) a[i] += q[g * D + dd] * k[dd];
        out[g * stride] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
}

/* out[g * stride] = dot(q_g, k) for the G query heads of a kv head. */
static void scores(int64_t G, const float *q, const float *k, int64_t D, float *out, int64_t stride) {
    switch (G) {
#define DOTS(g) case g: dots_fixed(g, q, k, D, out, stride); return;
        DOTS(1) DOTS(2) DOTS(3) DOTS(4) DOTS(5) DOTS(6) DOTS(7) DOTS(8)
#undef DOTS
    }
    for (int64_t g = 0; g < G; g++) out[g * stride] = dot(q + g * D, k, D);
}

/* lanes 2i and 2i + 1 of (a, b) added, a's pairs then b's: one level of dot's tree for the vectors' lanes */
typedef int32_t vidx __attribute__((vector_size(VB * sizeof(int32_t))));
static inline vblock pair_sums(vblock a, vblock b) {
#if defined(__clang__)
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#else
    const vidx even = {0, 2, 4, 6, 8, 10, 12, 14}, odd = {1, 3, 5, 7, 9, 11, 13, 15};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
#endif
}

/* out[g * stride + j] = dot(q_g, k_j) for 8 consecutive keys k_0..k_7 (rows of D floats, D a multiple of LANES)
 * and the G query heads: each key's LANES partial sums as dot's, then dot's tree for the 8 keys at once, by
 * shuffles that add the same pairs (lanes 2i and 2i + 1, then those pairs' pairs, then the two halves). The
 * same bits as 8 G calls of dot, without a scalar tree per score (a large share of a score's work). */
static inline __attribute__((always_inline)) void scores8(int64_t G, const float *q, const float *k, int64_t D,
                                                          float *out, int64_t stride) {
    for (int64_t g = 0; g < G; g++) {
        vblock acc[8];
        for (int j = 0; j < 8; j++) acc[j] = (vblock){0};
        for (int64_t d = 0; d < D; d += LANES) {
            vblock qv;
            memcpy(&qv, q + g * D + d, sizeof qv);
            for (int j = 0; j < 8; j++) {
                vblock kv;
                memcpy(&kv, k + j * D + d, sizeof kv);
                acc[j] += qv * kv;
            }
        }
        const vblock lo = pair_sums(pair_sums(acc[0], acc[1]), pair_sums(acc[2], acc[3]));
        const vblock hi = pair_sums(pair_sums(acc[4], acc[5]), pair_sums(acc[6], acc[7]));
        const vblock r = pair_sums(lo, hi);
        memcpy(out + g * stride, &r, sizeof r);
    }
}

/* max_t x[t] over t < L, NaNs passed over: the value a fold of fmaxf gives, taken in LANES lanes (a max is
 * exact in any order). Only the sign of a zero maximum could differ, and no output reads it: exp(s - m) and
 * m + log(l) are the same for m = +0 and m = -0. Not libm's fmaxf: a call per score would cost a large share
 * of a decode step's attention. */
static inline float row_max(const float *x, int64_t L) {
    float mx[LANES];
    for (int i = 0; i < LANES; i++) mx[i] = -INFINITY;
    int64_t t = 0;
    for (; t + LANES <= L; t += LANES)
        for (int i = 0; i < LANES; i++) mx[i] = x[t + i] > mx[i] ? x[t + i] : mx[i];
    for (int i = 0; t < L; t++, i++) mx[i] = x[t] > mx[i] ? x[t] : mx[i];
    float m = mx[0];
    for (int i = 1; i < LANES; i++) m = mx[i] > m ? mx[i] : m;
    return m;
}

/* l[g] = sum_t e[g * stride + t] for t = 0..L-1 in ascending order, one running sum per head g < G (G a
 * compile-time constant): the G chains of additions side by side, so their latencies overlap. */
static inline __attribute__((always_inline)) void sums_fixed(const int G, const float *e, int64_t stride, int64_t L,
                                                             float *l) {
    float acc[MAX_G] = {0};
    for (int64_t t = 0; t < L; t++)
        for (int g = 0; g < G; g++) acc[g] += e[g * stride + t];
    for (int g = 0; g < G; g++) l[g] = acc[g];
}

static void row_sums(int64_t G, const float *e, int64_t stride, int64_t L, float *l) {
    switch (G) {
#define SUMS(g) case g: sums_fixed(g, e, stride, L, l); return;
        SUMS(1) SUMS(2) SUMS(3) SUMS(4) SUMS(5) SUMS(6) SUMS(7) SUMS(8)
#undef SUMS
    }
    for (int64_t g = 0; g < G; g++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < L; t++) acc += e[g * stride + t];
        l[g] = acc;
    }
}

/* The attention plan's checks of a token layout, in one pass (the kernel then reads pages unchecked):
 * returns 1 if a position is < 0 or a sequence outside the table's S rows, 2 if a key position (0 up to the
 * last query position of its sequence) has no page (j >= J or table -1), else 0 with out[0] = the longest
 * key range (max position + 1) and out[1] = the highest page any query row reads (-1 if none).
 * last_S is scratch of S int64. */
int exactrl_check_layout(const int64_t *seq_N, const int64_t *pos_N, int64_t N, const int64_t *table_SJ,
                         int64_t S, int64_t J, int64_t B, int64_t *last_S, int64_t *out) {
    int64_t max_pos = -1, max_page = -1;
    for (int64_t s = 0; s < S; s++) last_S[s] = -1;
    for (int64_t n = 0; n < N; n++) {
        if (pos_N[n] < 0 || seq_N[n] < 0 || seq_N[n] >= S) return 1;
        if (pos_N[n] > last_S[seq_N[n]]) last_S[seq_N[n]] = pos_N[n];
        if (pos_N[n] > max_pos) max_pos = pos_N[n];
    }
    for (int64_t s = 0; s < S; s++) {
        if (last_S[s] < 0) continue;
        if (last_S[s] / B >= J) return 2;
        for (int64_t j = 0; j <= last_S[s] / B; j++) {
            const int64_t page = table_SJ[s * J + j];
            if (page < 0) return 2;
            if (page > max_page) max_page = page;
        }
    }
    out[0] = max_pos + 1;
    out[1] = max_page;
    return 0;
}

/* A thread's scratch memory of `floats` floats, or NULL with *failed set (its call then returns 1). */
static float *thread_scratch(size_t floats, int *failed) {
    float *p = malloc(sizeof(float) * floats);
    if (p == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

/* The first key a query row at position p reads: 0, or its sliding window's first (window > 0). */
static inline int64_t window_start(int64_t p, int64_t window) {
    return window > 0 && p + 1 > window ? p + 1 - window : 0;
}

/* Returns 0, or 1 if a thread could not allocate its scratch memory. window: keys per query row, 0 for all. */
int exactrl_attention(const void *q, const void *k_pages, const void *v_pages, int bf16,
                      const int64_t *seq_N, const int64_t *pos_N, const int64_t *table_SJ,
                      int64_t N, int64_t H, int64_t Hk, int64_t D, int64_t B, int64_t J, int64_t window,
                      float scale, float softcap, float *out, float *lse, int threads) {
    const int64_t G = H / Hk, row_bytes = D * (bf16 ? 2 : 4);
    int64_t max_len = 0;  /* the longest key range (max position + 1): the score rows' length */
    for (int64_t n = 0; n < N; n++) max_len = pos_N[n] + 1 > max_len ? pos_N[n] + 1 : max_len;
    int failed = 0;
    FP_MODE_OF_CALLER;
#pragma omp parallel num_threads(threads)
    {
        FP_MODE_ENTER;
        /* per thread: G query rows, G score rows of max_len, G accumulators, one K row, one V row, G sums */
        float *qs = thread_scratch((size_t)(G * D + G * max_len + G * D + 2 * D + G), &failed);
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < N * Hk; item++) {
            if (qs == NULL) continue;
            float *sc = qs + G * D, *acc = sc + G * max_len, *kbuf = acc + G * D, *vbuf = kbuf + D, *l = vbuf + D;
            const int64_t n = item / Hk, kvh = item % Hk, s = seq_N[n], L = pos_N[n] + 1;
            const int64_t lo = window_start(pos_N[n], window);
            for (int64_t g = 0; g < G; g++) {
                const int64_t row = n * H + kvh * G + g;
                for (int64_t d = 0; d < D; d++)
                    qs[g * D + d] = scale * (bf16 ? bf16_to_float(((const uint16_t *)q)[row * D + d])
                                                  : ((const float *)q)[row * D + d]);
            }
            for (int64_t t0 = lo / B * B; t0 < L; t0 += B) {  /* page by page: key t is slot t - t0 of page t0 / B */
                const int64_t base = (table_SJ[s * J + t0 / B] * Hk + kvh) * B - t0, end = t0 + B < L ? t0 + B : L;
                /* speed only: while key t is scored, the key in its slot one page ahead (this sequence's next
                 * page, else the next item's first) and value t start coming from memory (a layer's KV store
                 * is larger than the caches); a page ahead is faster than a few keys ahead. Into L2, not L1
                 * (locality 1, prefetcht1): an item's values do not fit in L1 beside its keys, and L2
                 * prefetches make the step's attention faster than L1 ones. */
                const int64_t next = item + 1, ahead =
                    t0 + B < L ? (table_SJ[s * J + t0 / B + 1] * Hk + kvh) * B - t0
                    : next < N * Hk ? (table_SJ[seq_N[next / Hk] * J] * Hk + next % Hk) * B - t0 : base;
                for (int64_t t = t0 > lo ? t0 : lo; t < end;) {
                    const int64_t keys = !bf16 && D % LANES == 0 && end - t >= 8 ? 8 : 1;
                    for (int64_t j = t; j < t + keys; j++)
                        for (int64_t off = 0; off < row_bytes; off += 64) {
                            __builtin_prefetch((const char *)k_pages + (ahead + j) * row_bytes + off, 0, 1);
                            __builtin_prefetch((const char *)v_pages + (base + j) * row_bytes + off, 0, 1);
                        }
                    if (keys == 8)
                        scores8(G, qs, (const float *)k_pages + (base + t) * D, D, sc + t, max_len);
                    else
                        scores(G, qs, load_row(k_pages, bf16, base + t, D, kbuf), D, sc + t, max_len);
                    t += keys;
                }
            }
            if (softcap > 0.0f)
                for (int64_t g = 0; g < G; g++)
                    for (int64_t t = lo; t < L; t++)
                        sc[g * max_len + t] = softcap * tanh_f(sc[g * max_len + t] / softcap);
            for (int64_t g = 0; g < G; g++) {
                const float m = row_max(sc + g * max_len + lo, L - lo);
                for (int64_t t = lo; t < L; t++) sc[g * max_len + t] = exp_f(sc[g * max_len + t] - m);
                if (lse != NULL) lse[n * H + kvh * G + g] = m;
            }
            weighted_values(v_pages, bf16, sc, max_len, G, lo, L, D, B, table_SJ + s * J, Hk, kvh, acc, vbuf);
            row_sums(G, sc + lo, max_len, L - lo, l);
            for (int64_t g = 0; g < G; g++) {
                float *o = out + (n * H + kvh * G + g) * D;
                for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] / l[g];
                if (lse != NULL) lse[n * H + kvh * G + g] += logf(l[g]);
            }
        }
        free(qs);
        FP_MODE_LEAVE;
    }
    return failed;
}

/* The gradient of exactrl_attention (fp32 operands): with o the forward's output, lse its log-sum-exp and
 * g the output's gradient, for query row n (sequence s, position p) and head h of kv head kvh,
 *
 *     P_t  = exp(s_t - lse)          s_t = (scale q) . k_t as the forward's, t = w..p (its window)
 *     dS_t = P_t (g . v_t - g . o)   times (1 - tanh(s_t / c)^2) with a soft cap c > 0 (s_t then capped)
 *     dq   = scale sum_t dS_t k_t;   dk_t += dS_t (scale q);   dv_t += P_t g
 *
 * (the flash-attention backward). No bit of a gradient needs to be batch-invariant, but every one is
 * deterministic: item (s, kvh) is computed by one thread, its query rows in their order in the call, and
 * it alone adds to its sequence's key and value gradients, dk_S / dv_S [S, Hk, J * B, D] (key t of s at
 * t; zero on entry), which the caller sums into the pages, some of which sequences share. dq [N, H, D].
 * The layout must have passed exactrl_check_layout. Returns 0, or 1 if scratch memory could not be allocated. */
int exactrl_attention_backward(const float *q, const float *k_pages, const float *v_pages, const float *o,
                               const float *lse, const float *g, const int64_t *seq_N, const int64_t *pos_N,
                               const int64_t *table_SJ, int64_t N, int64_t S, int64_t H, int64_t Hk, int64_t D,
                               int64_t B, int64_t J, int64_t window, float scale, float softcap, float *dq,
                               float *dk_S, float *dv_S, int threads) {
    const int64_t G = H / Hk, Lmax = J * B;
    /* each sequence's query rows in call order (a counting sort) and its last position (-1: none) */
    int64_t *start = calloc((size_t)(3 * S + 1 + N), sizeof(int64_t)); /* start [S + 1], at [S], last [S], rows [N] */
    if (start == NULL) return 1;
    int64_t *at = start + S + 1, *last = at + S, *rows = last + S, max_len = 0;
    for (int64_t s = 0; s < S; s++) last[s] = -1;
    for (int64_t n = 0; n < N; n++) {
        start[seq_N[n] + 1]++;
        if (pos_N[n] > last[seq_N[n]]) last[seq_N[n]] = pos_N[n];
        if (pos_N[n] + 1 > max_len) max_len = pos_N[n] + 1;
    }
    for (int64_t s = 0; s < S; s++) start[s + 1] += start[s], at[s] = start[s];
    for (int64_t n = 0; n < N; n++) rows[at[seq_N[n]]++] = n;
    int failed = 0;
    FP_MODE_OF_CALLER;
#pragma omp parallel num_threads(threads)
    {
        FP_MODE_ENTER;
        /* per thread: G scaled query rows, G gradient rows, G dq rows, G deltas, and G rows of P and dS */
        float *qs = thread_scratch((size_t)(3 * G * D + G + 2 * G * max_len + 1), &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < S * Hk; item++) {
            if (qs == NULL) continue;
            float *go = qs + G * D, *gq = go + G * D, *delta = gq + G * D, *pr = delta + G, *ds = pr + G * max_len;
            const int64_t s = item / Hk, kvh = item % Hk;
            float *dk = dk_S + item * Lmax * D, *dv = dv_S + item * Lmax * D;
            if (last[s] < 0) continue;
            for (int64_t r = start[s]; r < start[s + 1]; r++) {
                const int64_t n = rows[r], L = pos_N[n] + 1, lo = window_start(pos_N[n], window);
                for (int64_t h = 0; h < G; h++) {
                    const int64_t row = n * H + kvh * G + h;
                    float dl = 0.0f;
                    for (int64_t d = 0; d < D; d++) {
                        qs[h * D + d] = scale * q[row * D + d];
                        go[h * D + d] = g[row * D + d];
                        gq[h * D + d] = 0.0f;
                        dl += g[row * D + d] * o[row * D + d];
                    }
                    delta[h] = dl;
                }
                /* pass 1: scores and g . v_t of every key, 8 keys at a time where a page holds 8 more */
                for (int64_t t0 = lo / B * B; t0 < L; t0 += B) {
                    const int64_t base = (table_SJ[s * J + t0 / B] * Hk + kvh) * B - t0, end = t0 + B < L ? t0 + B : L;
                    for (int64_t t = t0 > lo ? t0 : lo; t < end;) {
                        if (D % LANES == 0 && end - t >= 8) {
                            scores8(G, qs, k_pages + (base + t) * D, D, pr + t, max_len);
                            scores8(G, go, v_pages + (base + t) * D, D, ds + t, max_len);
                            t += 8;
                        } else {
                            scores(G, qs, k_pages + (base + t) * D, D, pr + t, max_len);
                            scores(G, go, v_pages + (base + t) * D, D, ds + t, max_len);
                            t += 1;
                        }
                    }
                }
                for (int64_t h = 0; h < G; h++) {
                    const float m = lse[n * H + kvh * G + h];
                    float *p = pr + h * max_len, *e = ds + h * max_len;
                    if (softcap > 0.0f)
                        for (int64_t t = lo; t < L; t++) {
                            const float th = tanh_f(p[t] / softcap);
                            p[t] = exp_f(softcap * th - m);
                            e[t] = p[t] * (e[t] - delta[h]) * (1.0f - th * th);
                        }
                    else
                        for (int64_t t = lo; t < L; t++) {
                            p[t] = exp_f(p[t] - m);
                            e[t] = p[t] * (e[t] - delta[h]);
                        }
                }
                /* pass 2: the sums over keys (dq) and over query rows (dk, dv) */
                for (int64_t t0 = lo / B * B; t0 < L; t0 += B) {
                    const int64_t base = (table_SJ[s * J + t0 / B] * Hk + kvh) * B - t0, end = t0 + B < L ? t0 + B : L;
                    for (int64_t t = t0 > lo ? t0 : lo; t < end; t++) {
                        const float *k = k_pages + (base + t) * D;
                        float *dkt = dk + t * D, *dvt = dv + t * D;
                        int64_t d = 0;
                        for (; d + VB <= D; d += VB) { /* dk_t, dv_t summed over the G heads in registers */
                            vblock kk, a, b;
                            memcpy(&kk, k + d, sizeof kk), memcpy(&a, dvt + d, sizeof a), memcpy(&b, dkt + d, sizeof b);
                            for (int64_t h = 0; h < G; h++) {
                                const float p = pr[h * max_len + t], e = ds[h * max_len + t];
                                vblock gh, qh, c;
                                memcpy(&gh, go + h * D + d, sizeof gh), memcpy(&qh, qs + h * D + d, sizeof qh);
                                memcpy(&c, gq + h * D + d, sizeof c);
                                a += p * gh, b += e * qh, c += e * kk;
                                memcpy(gq + h * D + d, &c, sizeof c);
                            }
                            memcpy(dvt + d, &a, sizeof a), memcpy(dkt + d, &b, sizeof b);
                        }
                        for (int64_t h = 0; h < G; h++)
                            for (int64_t dd = d; dd < D; dd++) {
                                const float p = pr[h * max_len + t], e = ds[h * max_len + t];
                                dvt[dd] += p * go[h * D + dd], dkt[dd] += e * qs[h * D + dd];
                                gq[h * D + dd] += e * k[dd];
                            }
                    }
                }
                for (int64_t h = 0; h < G; h++)
                    for (int64_t d = 0; d < D; d++) dq[(n * H + kvh * G + h) * D + d] = scale * gq[h * D + d];
            }
        }
        free(qs);
        FP_MODE_LEAVE;
    }
    free(start);
    return failed;
}

/* Round-to-nearest-even of a float to bfloat16's 16 high bits (finite values; NaN stays NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* RMSNorm of each row, every row by one thread in one fixed order (docs/design.md §4.3):
 *
 *     r   = 1 / sqrt((sum_d x_d^2) / D + eps)     x in fp32, D summed in 8 fixed lanes then a fixed tree
 *     y_d = round_dtype(x_d * r);   out_d = round_dtype(w_d * y_d)
 *
 * (the rounding to the model dtype between the two products is Hugging Face's, kept for bf16).
 * x, w, out are [rows, D] / [D] / [rows, D] of the same dtype (float32 or bfloat16).
 */
void exactrl_rms_norm(const void *x, const void *w, int bf16, int64_t rows, int64_t D, float eps, void *out,
                      int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel num_threads(threads) if (rows * D >= 65536)
    {
        FP_MODE_ENTER;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            float acc[LANES] = {0};
            int64_t d = 0;
            if (bf16) {
                const uint16_t *xr = (const uint16_t *)x + i * D, *wr = (const uint16_t *)w;
                uint16_t *o = (uint16_t *)out + i * D;
                for (; d + LANES <= D; d += LANES)
                    for (int l = 0; l < LANES; l++) { float v = bf16_to_float(xr[d + l]); acc[l] += v * v; }
                for (int l = 0; d < D; d++, l++) { float v = bf16_to_float(xr[d]); acc[l] += v * v; }
                const float ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                const float r = 1.0f / sqrtf(ss / (float)D + eps);
                for (d = 0; d < D; d++) {
                    const float y = bf16_to_float(float_to_bf16(bf16_to_float(xr[d]) * r));
                    o[d] = float_to_bf16(bf16_to_float(wr[d]) * y);
                }
            } else {
                const float *xr = (const float *)x + i * D, *wr = (const float *)w;
                float *o = (float *)out + i * D;
                const float r = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);  /* the same lanes and tree as bf16 */
                for (d = 0; d < D; d++) o[d] = wr[d] * (xr[d] * r);
            }
        }
        FP_MODE_LEAVE;
    }
}

/* The gradient of the fp32 RMSNorm above (gradients carry no bitwise contract: any order will do), with
 * n = x r the normalised row and g the output's gradient:
 *
 *     dx = r (g w - n (sum_d g_d w_d n_d) / D)        dw += g n   (over the rows)
 *
 * dw_part is [threads, D], zeroed by the caller: each thread adds its rows' terms into its own row, and the
 * caller sums them. One pass where autograd of the torch expression takes ~10 ops of [rows, D] temporaries. */
void exactrl_rms_norm_backward(const float *x, const float *w, const float *g, int64_t rows, int64_t D, float eps,
                               float *dx, float *dw_part, int threads) {
    FP_MODE_OF_CALLER;
#pragma omp parallel num_threads(threads) if (rows * D >= 65536)
    {
        FP_MODE_ENTER;
#ifdef _OPENMP
        float *dw = dw_part + (int64_t)omp_get_thread_num() * D;
#else
        float *dw = dw_part;
#endif
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            const float *xr = x + i * D, *gr = g + i * D;
            float *o = dx + i * D;
            const float r = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);
            float c = 0.0f;
            for (int64_t d = 0; d < D; d++) {
                const float n = xr[d] * r;
                c += gr[d] * w[d] * n;
                dw[d] += gr[d] * n;
            }
            c /= (float)D;
            for (int64_t d = 0; d < D; d++) o[d] = r * (gr[d] * w[d] - xr[d] * r * c);
        }
        FP_MODE_LEAVE;
    }
}

/* Rotate-half RoPE, elementwise, with torch's roundings (so its bits equal the torch expression
 * `x * cos + cat(-x2, x1) * sin` in x's dtype, cos/sin first rounded to it):
 *
 *     out_d = round(round(x_d * c_d) + round(r_d * s_d)),   r = (-x[D/2:], x[:D/2])
 *
 * x, out [N, H, D] of one dtype; cos, sin [N, D] float32, row n at n * table_stride floats (>= D: a
 * slice of wider tables, Gemma 3's [global | local]).
 */
void exactrl_rotary(const void *x, const float *cos_ND, const float *sin_ND, int bf16, int64_t N, int64_t H,
                    int64_t D, void *out, int64_t table_stride) {
    const int64_t half = D / 2;
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t row = (n * H + h) * D;
            const float *c = cos_ND + n * table_stride, *s = sin_ND + n * table_stride;
            if (bf16) {
                const uint16_t *xr = (const uint16_t *)x + row;
                uint16_t *o = (uint16_t *)out + row;
                for (int64_t d = 0; d < D; d++) {
                    const float xd = bf16_to_float(xr[d]);
                    const float rd = d < half ? -bf16_to_float(xr[d + half]) : bf16_to_float(xr[d - half]);
                    const float a = bf16_to_float(float_to_bf16(xd * bf16_to_float(float_to_bf16(c[d]))));
                    const float b = bf16_to_float(float_to_bf16(rd * bf16_to_float(float_to_bf16(s[d]))));
                    o[d] = float_to_bf16(a + b);
                }
            } else {
                const float *xr = (const float *)x + row;
                float *o = (float *)out + row;
                for (int64_t d = 0; d < half; d++) o[d] = xr[d] * c[d] + (-xr[d + half]) * s[d];
                for (int64_t d = half; d < D; d++) o[d] = xr[d] * c[d] + xr[d - half] * s[d];
            }
        }
}

/* dst row rows[i] = src row i, for i < n, rows of `row_bytes` bytes (a KV store's new keys or values; the
 * caller checked every rows[i] is inside dst). A copy, so any dtype. */
void exactrl_write_rows(const void *src, const int64_t *rows, int64_t n, int64_t row_bytes, void *dst) {
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)dst + rows[i] * row_bytes, (const char *)src + i * row_bytes, (size_t)row_bytes);
}
