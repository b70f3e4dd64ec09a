/* exactrl's exact fp32 linear: y [M, N] = x [M, K] . w^T, w [N, K].
 *
 * Every output element is summed in one order that depends on K alone
 * (docs/design.md §4.1), never on M, on the row's neighbours, on N or on
 * the thread that computes it:
 *
 *     s_b    = fma chain over the k of block b, k ascending, from 0:
 *              s = 0; s = fma(x[m, k], w[n, k], s)          blocks of KC = 256 k's
 *     y[m,n] = ((s_0 + s_1) + s_2) + ...                     blocks ascending
 *
 * (Summing in blocks of 256 keeps the rounding error near a blocked GEMM's:
 * one fma chain over a long K has several times the error of torch's
 * `F.linear`.)
 * fma rounds once, whatever instruction computes it, so the AVX-512, AVX2
 * and portable builds below give the same bits, and so does a row computed
 * alone or among thousands. KC is part of that contract: never vary it.
 *
 * Speed: the weight is packed once (`exactrl_pack_weight`) into panels of NR
 * columns, [panel][k][NR], so that a register-blocked micro-kernel of MR rows
 * x NR columns (2 x MR vector accumulators) reads each packed row of the
 * panel once per MR rows and broadcasts the rows' x[m, k] (the layout of
 * BLIS / GotoBLAS micro-kernels). Work is split over panels, so one thread
 * computes each output from start to end. With a few blocks of rows (a decode
 * step's batch), each block also prefetches its share of the next chunk into
 * L2, so memory is read while all the blocks compute, not only the first: a
 * decode step's products stream their weights from memory, and this hides
 * much of that behind the compute. Speeds against `F.linear` are in
 * docs/performance.md ("Kernel measurements").
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fpmode.h"

#if defined(__AVX512F__) && !defined(EXACTRL_PORTABLE)
#include <immintrin.h>
#define W 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define MR 12
#define BUILD "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && !defined(EXACTRL_PORTABLE)
#include <immintrin.h>
#define W 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define MR 6
#define BUILD "avx2"
#else
#include <math.h>
#define W 8 /* no AVX2 (or EXACTRL_PORTABLE): the same sums with C's fmaf, which the compiler may vectorise */
#define MR 4
#define PORTABLE 1
#define BUILD "portable"
#endif
#define NR (2 * W)
#define KC 256 /* the contract above */
#ifndef PF
#define PF 64
#endif
#define MC 96  /* rows of x kept in cache while a thread walks its panels: speed only */
/* Rows of x whose stride is a multiple of 2 KB (K a multiple of 512) fall into one or two of L1's 64 sets
 * (32 KB, 8-way: a 4 KB period), so a micro-kernel's 12 rows evict each other and the panel, and such a K
 * (a 100M model's MLP down projection: K = 2048) would run far slower than a K just off the multiple. Such x
 * is first copied, one chunk of MC rows at a time, into a buffer of row stride K + PAD. Speed only: the
 * values, and so every sum, are the same. */
#define PAD 16

/* The calling thread's copy buffer, grown as needed and kept (a fresh 800 KB allocation per call would be
 * mapped and faulted in each time). Per calling thread: an engine and a trainer may run on two. */
static float *chunk_buffer(int64_t floats) {
    static __thread float *buf = NULL;
    static __thread int64_t size = 0;
    if (floats > size) {
        free(buf);
        buf = aligned_alloc(64, (size_t)floats * sizeof(float));
        size = buf ? floats : 0;
    }
    return buf;
}

const char *exactrl_gemm_build(void) { return BUILD; }
int64_t exactrl_gemm_panel_width(void) { return NR; }

/* w [N, K] -> out [ceil(N / NR)][K][NR], columns past N zero. Read a block of 16 k's of the panel's rows
 * at a time, so each row's cache line is used whole while the panel is written in order. */
void exactrl_pack_weight(const float *w, int64_t N, int64_t K, float *out, int threads) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads) if (N * K >= (1 << 18))
    for (int64_t p = 0; p < panels; p++) {
        float *o = out + p * K * NR;
        const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
        const float *wp = w + p * NR * K;
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            const int64_t k1 = k0 + 16 < K ? k0 + 16 : K;
            for (int64_t j = 0; j < cols; j++)
                for (int64_t k = k0; k < k1; k++) o[k * NR + j] = wp[j * K + k];
            for (int64_t j = cols; j < NR; j++)
                for (int64_t k = k0; k < k1; k++) o[k * NR + j] = 0.0f;
        }
    }
}

/* The panels `exactrl_pack_weight` makes of w = sᵀ, read straight from s [K, N] (row-major): panel p's
 * row k is s[k, p·NR ..], contiguous, so no transposed copy of s is made (the trainer's weight gradient
 * gᵀx packs the transpose of an activation of thousands of rows). */
void exactrl_pack_weight_t(const float *s, int64_t K, int64_t N, float *out, int threads) {
    const int64_t panels = (N + NR - 1) / NR;
    /* by rows of s (each read once, in order), every panel's row k written from it */
#pragma omp parallel for schedule(static) num_threads(threads) if (N * K >= (1 << 18))
    for (int64_t k = 0; k < K; k++) {
        const float *sk = s + k * N;
        for (int64_t p = 0; p < panels; p++) {
            float *o = out + p * K * NR + k * NR;
            const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
            for (int64_t j = 0; j < cols; j++) o[j] = sk[p * NR + j];
            for (int64_t j = cols; j < NR; j++) o[j] = 0.0f;
        }
    }
}

/* The mr x NR outputs at c (row stride ldc) of k's [k0, k1): stored (first block) or added to c. */
static inline __attribute__((always_inline)) void block(const int mr, const float *x, int64_t ldx, const float *b,
                                                        int64_t k0, int64_t k1, float *c, int64_t ldc, int first,
                                                        int prefetch, const float *ahead, int every) {
#ifdef PORTABLE
    (void)prefetch, (void)ahead, (void)every;
    float acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = 0.0f;
    for (int64_t k = k0; k < k1; k++)
        for (int i = 0; i < mr; i++) {
            const float a = x[i * ldx + k];
            for (int j = 0; j < NR; j++) acc[i][j] = fmaf(a, b[k * NR + j], acc[i][j]);
        }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) c[i * ldc + j] = first ? acc[i][j] : c[i * ldc + j] + acc[i][j];
#else
    vf acc0[MR], acc1[MR];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++)
        if (i < mr) acc0[i] = acc1[i] = VZERO();
    int since = 0;
    for (int64_t k = k0; k < k1; k++) {
        if (every && ++since == every) { /* one row of the next chunk, from memory into L2 (see exactrl_linear_multi) */
            since = 0;
            _mm_prefetch((const char *)ahead, _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + W), _MM_HINT_T1);
            ahead += NR;
        }
        if (prefetch) { /* the panel's rows PF ahead, into L1 while these compute */
            _mm_prefetch((const char *)(b + (k + PF) * NR), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + (k + PF) * NR + W), _MM_HINT_T0);
        }
        const vf b0 = VLOAD(b + k * NR), b1 = VLOAD(b + k * NR + W);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++)
            if (i < mr) {
                const vf a = VBCAST(x + i * ldx + k);
                acc0[i] = VFMA(a, b0, acc0[i]);
                acc1[i] = VFMA(a, b1, acc1[i]);
            }
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++)
        if (i < mr) {
            float *ci = c + i * ldc;
            if (first) {
                VSTORE(ci, acc0[i]);
                VSTORE(ci + W, acc1[i]);
            } else {
                VSTORE(ci, VADD(VLOAD(ci), acc0[i]));
                VSTORE(ci + W, VADD(VLOAD(ci + W), acc1[i]));
            }
        }
#endif
}

/* `block` with mr a compile-time constant, so its loops unroll into registers. */
static void block_rows(int mr, const float *x, int64_t ldx, const float *b, int64_t k0, int64_t k1, float *c,
                       int64_t ldc, int first, int prefetch, const float *ahead, int every) {
    switch (mr) {
#define ROWS(m) case m: block(m, x, ldx, b, k0, k1, c, ldc, first, prefetch, ahead, every); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if MR > 4
        ROWS(5) ROWS(6)
#endif
#if MR > 6
        ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
#undef ROWS
    }
}

/* y_s [M, N_s] = x [M, K] . w_s^T for the n weights w_0..w_n-1 of one input (a layer's q/k/v or gate/up
 * projections), their packed panels one after another in wp (each weight's packed by `exactrl_pack_weight`,
 * its last panel zero-padded), the outputs one after another in y (y_0 [M, N_0], then y_1, ...); x
 * contiguous. Each output is the same sum as a call per weight (the order depends on K alone): one call
 * spares the calls and reads x once. */
void exactrl_linear_multi(const float *x, const float *wp, int64_t M, int64_t K, int64_t n, const int64_t *N_s,
                          float *y_all, int threads) {
    int64_t panels = 0, N_all = 0;
    for (int64_t s = 0; s < n; s++) {
        panels += (N_s[s] + NR - 1) / NR;
        N_all += N_s[s];
    }
    if (K == 0) {
        memset(y_all, 0, sizeof(float) * M * N_all);
        return;
    }
    const int64_t ldcopy = K + PAD; /* the copy's row stride */
    float *copy = K % 512 == 0 ? chunk_buffer((M < MC ? M : MC) * ldcopy) : NULL; /* NULL: read x in place */
    FP_MODE_OF_CALLER;
#pragma omp parallel num_threads(threads) if (M * N_all * K >= (1 << 16))
    {
        FP_MODE_ENTER;
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t m1 = m0 + MC < M ? m0 + MC : M;
            const int blocks = (int)((m1 - m0 + MR - 1) / MR), spread = M <= MC && blocks >= 3;
            const float *xm = x + m0 * K; /* row m0 of the x the blocks read, row stride ldx */
            int64_t ldx = K;
            if (copy) { /* the barrier ending this loop: the copy is whole before any block reads it */
    #pragma omp for schedule(static)
                for (int64_t r = m0; r < m1; r++) memcpy(copy + (r - m0) * ldcopy, x + r * K, sizeof(float) * K);
                xm = copy, ldx = ldcopy;
            } /* and the barrier ending the panels' loop: all have read it before the next chunk is copied */
    #pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const float *b = wp + p * K * NR;
                int64_t s = 0, q = p;  /* weight s, its panel q, its output y */
                float *y = y_all;
                while (q >= (N_s[s] + NR - 1) / NR) q -= (N_s[s] + NR - 1) / NR, y += M * N_s[s++];
                const int64_t N = N_s[s], n0 = q * NR, cols = N - n0 < NR ? N - n0 : NR;
                float part[MR * NR]; /* a last, partial panel's outputs, all NR columns */
                if (cols < NR) memset(part, 0, sizeof part);
                for (int64_t k0 = 0; k0 < K; k0 += KC) {
                    const int64_t k1 = k0 + KC < K ? k0 + KC : K;
                    for (int64_t i = m0; i < m1; i += MR) {
                        const int mr = m1 - i < MR ? (int)(m1 - i) : MR;
                        /* each block of rows fetches 1/blocks of the next chunk (which starts at b + k1 * NR, in
                         * this panel or the next) */
                        const int j = (int)((i - m0) / MR), every = spread ? blocks : 0;
                        const float *ahead = b + (k1 + j * (k1 - k0) / blocks) * NR;
                        if (cols == NR) {
                            block_rows(mr, xm + (i - m0) * ldx, ldx, b, k0, k1, y + i * N + n0, N, k0 == 0, i == m0,
                                       ahead, every);
                            continue;
                        }
                        if (k0 > 0)
                            for (int r = 0; r < mr; r++)
                                memcpy(part + r * NR, y + (i + r) * N + n0, sizeof(float) * cols);
                        block_rows(mr, xm + (i - m0) * ldx, ldx, b, k0, k1, part, NR, k0 == 0, i == m0, ahead,
                                   every);
                        for (int r = 0; r < mr; r++)
                            memcpy(y + (i + r) * N + n0, part + r * NR, sizeof(float) * cols);
                    }
                }
            }
        }
        FP_MODE_LEAVE;
    }
}

/* y [M, N] = x [M, K] . w^T with w packed by `exactrl_pack_weight`; x, y contiguous. */
void exactrl_linear(const float *x, const float *wp, int64_t M, int64_t N, int64_t K, float *y, int threads) {
    exactrl_linear_multi(x, wp, M, K, 1, &N, y, threads);
}
