/* Replays a recorded sequence of kernel calls (exactrl/engine/graph.py) in one C loop, where each call made
 * from Python pays for the interpreter and torch around the kernel, which for a decode step's small kernels
 * is a large share of their time. An op names its kernel and holds the arguments it was called with:
 * argument i in a[i] if it is a pointer or an integer, the floats in f[] in their order (their a[i] unused).
 * The same calls with the same arguments: the same bits. */
#include <stdint.h>

#define P(i) ((void *)(intptr_t)a[i])

typedef struct {
    int64_t kind; /* index into KERNELS */
    int64_t a[19];
    double f[2];
} exactrl_op;

/* The kernels a graph can hold, in the order of `kind` (graph.py reads this list). */
static const char KERNELS[] =
    "exactrl_linear,exactrl_linear_multi,exactrl_rms_norm,exactrl_rotary,exactrl_write_rows,exactrl_attention,"
    "exactrl_swiglu,exactrl_add,exactrl_scale,exactrl_geglu,exactrl_softcap,exactrl_moe,exactrl_sigmoid_gate,"
    "exactrl_clamp";
const char *exactrl_graph_kernels(void) { return KERNELS; }

void exactrl_linear(const float *, const float *, int64_t, int64_t, int64_t, float *, int);
void exactrl_linear_multi(const float *, const float *, int64_t, int64_t, int64_t, const int64_t *, float *, int);
void exactrl_rms_norm(const void *, const void *, int, int64_t, int64_t, float, void *, int);
void exactrl_rotary(const void *, const float *, const float *, int, int64_t, int64_t, int64_t, void *, int64_t);
void exactrl_write_rows(const void *, const int64_t *, int64_t, int64_t, void *);
int exactrl_attention(const void *, const void *, const void *, int, const int64_t *, const int64_t *,
                      const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                      float *, float *, int);
void exactrl_swiglu(const float *, const float *, int64_t, float *, int);
void exactrl_add(const float *, const float *, int64_t, int64_t, float *);
void exactrl_scale(const float *, int64_t, float, float *);
void exactrl_geglu(const float *, const float *, int64_t, float *, int);
void exactrl_softcap(const float *, int64_t, float, float *, int);
void exactrl_clamp(const float *, int64_t, float, float, float *);
void exactrl_sigmoid_gate(const float *, const float *, int64_t, int64_t, float *);
int exactrl_moe(const float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t, int, const int64_t *,
                const int64_t *, float *, int64_t *, float *, int);

/* Returns 0, or 1 + the index of an op that failed (exactrl_attention's or exactrl_moe's scratch allocation). */
int64_t exactrl_graph_run(const exactrl_op *ops, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *a = ops[i].a;
        const double *f = ops[i].f;
        switch (ops[i].kind) {
        case 0: exactrl_linear(P(0), P(1), a[2], a[3], a[4], P(5), (int)a[6]); break;
        case 1: exactrl_linear_multi(P(0), P(1), a[2], a[3], a[4], P(5), P(6), (int)a[7]); break;
        case 2: exactrl_rms_norm(P(0), P(1), (int)a[2], a[3], a[4], (float)f[0], P(6), (int)a[7]); break;
        case 3: exactrl_rotary(P(0), P(1), P(2), (int)a[3], a[4], a[5], a[6], P(7), a[8]); break;
        case 4: exactrl_write_rows(P(0), P(1), a[2], a[3], P(4)); break;
        case 5:
            if (exactrl_attention(P(0), P(1), P(2), (int)a[3], P(4), P(5), P(6), a[7], a[8], a[9], a[10], a[11],
                                  a[12], a[13], (float)f[0], (float)f[1], P(16), P(17), (int)a[18]))
                return i + 1;
            break;
        case 6: exactrl_swiglu(P(0), P(1), a[2], P(3), (int)a[4]); break;
        case 7: exactrl_add(P(0), P(1), a[2], a[3], P(4)); break;
        case 8: exactrl_scale(P(0), a[1], (float)f[0], P(3)); break;
        case 9: exactrl_geglu(P(0), P(1), a[2], P(3), (int)a[4]); break;
        case 10: exactrl_softcap(P(0), a[1], (float)f[0], P(3), (int)a[4]); break;
        case 11:
            if (exactrl_moe(P(0), P(1), a[2], a[3], a[4], a[5], a[6], (int)a[7], P(8), P(9), P(10), P(11), P(12),
                            (int)a[13]))
                return i + 1;
            break;
        case 12: exactrl_sigmoid_gate(P(0), P(1), a[2], a[3], P(4)); break;
        case 13: exactrl_clamp(P(0), a[1], (float)f[0], (float)f[1], P(4)); break;
        default: return i + 1;
        }
    }
    return 0;
}
