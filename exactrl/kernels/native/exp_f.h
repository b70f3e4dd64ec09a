/* exp_f: float32 exp in plain arithmetic, for exactrl's native kernels (exact.c, pointwise.c).
 *
 * Not libm's expf, for two reasons: a loop of it vectorises (libm's is a call per element), and its bits
 * are the same on every CPU and in every build (glibc picks an expf variant per CPU). No libm call but
 * `fmaf`, which rounds once whatever computes it (an FMA instruction, vectorised or not, or libm's exact
 * software fma on a CPU without one), and no other contraction (the kernels build with -ffp-contract=off):
 * the same roundings everywhere. The fused steps make the loops (log-softmax, the draw, entropy) faster than
 * separate multiply and add.
 */
#ifndef EXACTRL_EXP_F_H
#define EXACTRL_EXP_F_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EXP_HI 88.72283905f /* above: +inf (exp overflows float) */
#define EXP_LO (-86.0f)     /* below: 0 (exp < 2^-124; 2^n below stays a normal float) */

/* exp(x) in float32, within 1 ulp of the true value for x in [EXP_LO, EXP_HI] (0.998 at worst over 4M points;
 * tested):
 *     n = round(x / ln 2),  r = x - n ln 2  (ln 2 in two parts, so r is exact to float precision),
 *     exp(r) = 1 + r + r^2 P(r)  with P the degree-5 polynomial of Cephes's expf (S. Moshier), by Horner
 *              steps of fmaf,
 *     exp(x) = exp(r) * 2^(n-1) * 2  (two exact scalings: n can be 128 near EXP_HI).
 * Below EXP_LO it returns 0, above EXP_HI +inf, and NaN for NaN. */
static inline float exp_f(float x) {
    const float xc = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);
    const float t = xc * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds x / ln 2 to an integer */
    const float n = t - 12582912.0f;
    float r = fmaf(-n, 0.693359375f, xc);
    r = fmaf(-n, -2.12194440e-4f, r);
    const float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r2, r) + 1.0f;
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    const int32_t e = (bits - 0x4B400000 + 126) << 23; /* the float 2^(n-1) */
    float scale;
    memcpy(&scale, &e, sizeof scale);
    float y = (p * scale) * 2.0f;
    y = x < EXP_LO ? 0.0f : y;
    y = x > EXP_HI ? INFINITY : y;
    return x != x ? x : y;
}

/* tanh(x) in float32 from exp_f, plain arithmetic like it (the same bits in every build; loops vectorise):
 *     |x| <  1/16:  x + x^3 Q(x^2),  Q = -1/3 + 2/15 x^2 - 17/315 x^4   (Taylor; the next term is below
 *                   2^-36 relative there)
 *     |x| >= 1/16:  sign(x) (1 - 2 / (exp_f(2|x|) + 1))                  (1 exactly once exp_f overflows)
 * Within 2e-7 absolute of the true value everywhere (tested); NaN for NaN, -0 for -0. Gemma's logit soft-capping,
 * cap * tanh(z / cap), and gelu's tanh approximation use it. */
static inline float tanh_f(float x) {
    const float a = fabsf(x), x2 = x * x;
    float q = fmaf(x2, -17.0f / 315.0f, 2.0f / 15.0f);
    q = fmaf(q, x2, -1.0f / 3.0f);
    const float small = fmaf(x * x2, q, x);
    const float big = copysignf(1.0f - 2.0f / (exp_f(2.0f * a) + 1.0f), x);
    const float y = a < 0.0625f ? small : big;
    return x != x || x == 0.0f ? x : y; /* NaN, and the sign of a zero, kept */
}
#endif
